"""Weight update trainer GPU0 -> rollout GPU1 over NCCL through the GPU update program.

    source benchmarks/device_setup.sh && python3 benchmarks/weight_update_nccl.py --out $OUT/wu_nccl.json

Needs 2 GPUs (nvidia-h200-x2). Rank 0 = trainer: random BF16 weights on cuda:0 laid out as Megatron's grouped experts
(benchmarks/weight_update_gpu.grouped_weights), `WeightSender` over `TorchDistributedTransport(gpu_program=True)`:
per bucket of 512 MiB, quantize straight into a double-buffered wire buffer on cuda:0 and broadcast it
asynchronously, so the quantization of bucket k+1 overlaps the broadcast of bucket k. Rank 1 = rollout: one kept
`WeightReceiver` on cuda:1. Models: the 1.34B Qwen3-MoE-shaped one and the Qwen3-30B-A3B-shaped one (48 layers,
30.5B params, 61 GB BF16). Per policy, in the same run:
  * update      = from both ranks at a barrier until the receiver holds every byte (its stream synchronised) and
                  a second barrier has returned on rank 0; median of --reps after a warm-up update;
  * bare bcast  = NCCL broadcasts of the SAME bytes in the same bucket sizes, same barriers (the link limit);
  * BF16 bytes  = the bare broadcast of the BF16 bucket sizes, for "vs BF16";
  * one check_equal update (every byte fingerprinted on both ends) must pass.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

POLICIES = {"bf16": "bf16", "nvfp4": "nvfp4-pertoken-dequant-backward", "mxfp8": "mxfp8-e2e"}


def _barrier_time(fn, reps, dist, torch, dev):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        dist.barrier()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def bench_model(rank, label, cfg, reps, bucket_mb, results, min_buckets=8):
    import torch
    import torch.distributed as dist

    from weight_update_gpu import grouped_weights, summarize_vs_bf16

    from precision_dsl.arch import load_architecture
    from precision_dsl.backends.weight_update import TorchDistributedTransport, WeightReceiver, WeightSender
    from precision_dsl.resolve import resolve

    dev = torch.device(f"cuda:{rank}")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    arch = load_architecture(str(tmp))
    weights = grouped_weights(arch, dev) if rank == 0 else None
    n_params = sum(t.numel for t in arch.tensors)
    bf16_sizes = None
    for pname, pfile in POLICIES.items():
        plan = resolve(ROOT / "policies" / f"{pfile}.policy", arch)
        tr = TorchDistributedTransport(device=str(dev), gpu_program=True)
        if rank == 0:
            sender = WeightSender(plan, tr, bucket_bytes=bucket_mb << 20, min_buckets=min_buckets)
            t0 = time.perf_counter()
            prep = sender.prepare(weights.items())
            t_bind = time.perf_counter() - t0
            prog = sender.program()
            sizes = [b.nbytes for b in prog.buckets]
            step = lambda: sender.send(prep)  # noqa: E731
        else:
            rx = WeightReceiver(plan, tr, check_equal=False)  # the rollout's one receiver
            holder = {}

            def step():
                holder.clear()
                holder["raw"] = rx.receive_raw()
            sizes = None
        sizes = _bcast_obj(sizes, dist)
        if pname == "bf16":
            bf16_sizes = sizes
        step()  # warm-up: Triton compilation, allocator, layout check on the receiver
        med, ts = _barrier_time(step, reps, dist, torch, dev)
        if rank == 1:
            holder.clear()
            rx.raw = {}

        def bare(sz):
            src = torch.empty(max(sz), dtype=torch.uint8, device=dev)
            if rank == 0:
                src.random_(0, 255)
            bufs = [src[:n] if rank == 0 else torch.empty(n, dtype=torch.uint8, device=dev) for n in sz]

            def run():
                works = [dist.broadcast(b, src=0, async_op=True) for b in bufs]
                for w in works:
                    w.wait()
            return run

        run_bare = bare(sizes)
        run_bare()
        med_bare, _ = _barrier_time(run_bare, reps, dist, torch, dev)
        del run_bare
        if bf16_sizes is not sizes:
            run_bf16 = bare(bf16_sizes)
            run_bf16()
            med_bf16_bare, _ = _barrier_time(run_bf16, reps, dist, torch, dev)
            del run_bf16
        else:
            med_bf16_bare = med_bare
        torch.cuda.empty_cache()
        # one update with every byte fingerprinted on both ends (check_equal), not timed
        tr2 = TorchDistributedTransport(device=str(dev), gpu_program=True)
        ok = True
        if rank == 0:
            s2 = WeightSender(plan, tr2, bucket_bytes=bucket_mb << 20, check_equal=True)
            s2._program = prog
            s2.send(prep)
        else:
            try:
                WeightReceiver(plan, tr2, check_equal=True).receive_raw()
            except Exception as err:  # reported, not hidden
                ok = f"{type(err).__name__}: {err}"
        ok = _bcast_obj(ok, dist, src=1)
        if rank == 0:
            total = sum(sizes)
            row = {"model": label, "params": n_params, "policy": pname, "wire_bytes": total, "min_buckets": min_buckets,
                   "buckets": len(sizes), "tensors_out": prog.tensors, "bind_s": t_bind, "update_s": med,
                   "update_all_s": ts, "bare_bcast_s": med_bare, "bf16_bare_bcast_s": med_bf16_bare,
                   "update_over_bare": med / med_bare, "link_GBps": total / med_bare / 1e9,
                   "check_equal_update_ok": ok}
            results.append(row)
            print(f"[{label}] {pname:6s} {total / 1e9:7.2f} GB in {len(sizes):3d} buckets  update "
                  f"{med * 1e3:8.1f} ms  bare bcast {med_bare * 1e3:8.1f} ms ({total / med_bare / 1e9:5.0f} GB/s)  "
                  f"x{med / med_bare:4.2f} of bare  full-fingerprint update ok: {ok}", flush=True)
            del sender, prep
        torch.cuda.empty_cache()
    if rank == 0:
        summarize_vs_bf16(label, {r["policy"]: r for r in results if r["model"] == label}, "a bare broadcast")
    del weights
    torch.cuda.empty_cache()


def _bcast_obj(obj, dist, src=0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def worker(rank: int, args) -> None:
    import torch
    import torch.distributed as dist

    from weight_update_gpu import MOE_1B, QWEN3_30B

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device(f"cuda:{rank}"))
    results: list = []
    try:
        for mb in args.min_buckets:
            bench_model(rank, f"qwen3-moe-1.3b, min {mb} buckets", MOE_1B, args.reps,
                        args.bucket_mb, results, mb)
        if not args.skip_30b:
            bench_model(rank, f"qwen3-30b-a3b-shaped ({args.layers} layers)",
                        dict(QWEN3_30B, num_hidden_layers=args.layers), args.reps, args.bucket_mb, results)
    finally:
        if rank == 0:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                            "rows": results}, indent=1))
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("wu_nccl.json"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--skip-30b", action="store_true")
    ap.add_argument("--min-buckets", type=int, nargs="+", default=[8],
                    help="WeightSender(min_buckets=) values to run the 1.34B model with")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        sys.exit("weight_update_nccl.py needs 2 GPUs (nvidia-h200-x2)")
    mp.spawn(worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
