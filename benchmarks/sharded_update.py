"""Sharded weight update (backends/weight_update/sharded.py) vs a bare scatter of the same bytes.

    python benchmarks/sharded_update.py                       # CPU, gloo, tiny-moe, 2 trainer + 2 rollout ranks
    python benchmarks/sharded_update.py --backend nccl        # one GPU per rank (4 GPUs), NCCL

Per format: the update's wall time (handshake, gather of the trainer shards on trainer rank 0, quantization with
the converter's function, partition cut, per-rank transfer, both votes) against trainer rank 0 sending every rollout
rank the same number of bytes with plain point-to-point sends (the floor of any update that moves those bytes).
Median of --repeats after one warm-up. Prints one JSON object per format (and writes them to --out).
The trainer's state dicts stay on the host (rank 0 quantizes on the CPU); with NCCL only the transfers use the GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {
    "ep": dict(trainer_tp=2, trainer_ep=2, trainer_etp=1, rollout_tp=2, rollout_ep=2),
    "etp": dict(trainer_tp=2, trainer_ep=1, trainer_etp=2, rollout_tp=2, rollout_ep=1),
}
POLICIES = ["bf16", "mxfp8-e2e", "nvfp4-pertoken-hp-backward"]


def _worker(rank, args, port, src, results):
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from precision_dsl.arch import load_architecture
    from precision_dsl.backends.synthetic import megatron_shard, megatron_weights
    from precision_dsl.backends.weight_update import ShardedLayout, ShardedUpdate, partition_specs
    from precision_dsl.resolve import resolve

    layout = ShardedLayout(**LAYOUTS[args.layout])
    device = "cpu"
    if args.backend == "nccl":
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world))
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=layout.world)
    arch = load_architecture(args.model)
    hf = load_file(str(Path(src) / "model.safetensors"))
    rows = []
    for policy in args.policies:
        plan = resolve(REPO / "policies" / f"{policy}.policy", arch, None)
        up = ShardedUpdate(plan, layout, arch.config, bucket_bytes=args.bucket_mib << 20, device=device)
        shard = megatron_shard(megatron_weights(plan, arch.config, hf), layout, rank, arch.num_experts) \
            if layout.is_trainer(rank) else None
        times, reps = [], []
        for i in range(args.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            rep = up.update(shard) if shard is not None else up.update()[1]
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
                reps.append(rep)
        # the bare floor: rank 0 sends each rollout rank as many bytes as its partition holds
        sizes = {}
        for r in range(layout.trainer_world, layout.world):
            specs = partition_specs(plan, up.part(r))
            sizes[r] = sum(_nbytes(dt, sh) for dt, sh in specs.values())
        bare = []
        bufs = {r: torch.ones(n, dtype=torch.uint8, device=device) for r, n in sizes.items()}
        for i in range(args.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                for r, b in bufs.items():
                    dist.send(b, dst=r)
            elif rank in bufs:
                dist.recv(bufs[rank], src=0)
            dist.barrier()
            if i:
                bare.append(time.perf_counter() - t0)
        if rank == 0:
            phases = {k: statistics.median(r.seconds.get(k, 0.0) for r in reps)
                      for k in ("gather", "merge", "quantize", "partition", "transfer")}
            rows.append({"policy": policy, "layout": layout.__dict__, "backend": args.backend, "model": args.model,
                         "device": "cpu" if args.backend == "gloo" else torch.cuda.get_device_name(0),
                         "bytes_to_rollout": sum(sizes.values()), "update_s": statistics.median(times),
                         "bare_scatter_s": statistics.median(bare),
                         "ratio": statistics.median(times) / max(statistics.median(bare), 1e-9),
                         "rank0_phases_s": phases, "repeats": args.repeats})
    if rank == 0:
        Path(results).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _nbytes(dt: str, shape) -> int:
    per = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8}[dt]
    n = 1
    for s in shape:
        n *= s
    return n * per


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    from precision_dsl.arch import load_architecture
    from precision_dsl.backends.synthetic import write_synthetic_checkpoint
    from precision_dsl.backends.weight_update import ShardedLayout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="ep")
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    layout = ShardedLayout(**LAYOUTS[args.layout])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        write_synthetic_checkpoint(load_architecture(args.model), src, shards=1, seed=1)
        results = Path(tmp) / "results.json"
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(args, port, str(src), str(results)), nprocs=layout.world, join=True,
                           start_method="spawn")
        rows = json.loads(results.read_text())
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
