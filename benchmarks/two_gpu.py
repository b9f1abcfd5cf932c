"""Two-GPU measurements (nvidia-h200-x2): NCCL weight updates and expert-TP per-token scales.

    source benchmarks/device_setup.sh && python3 benchmarks/two_gpu.py --out $OUT/two_gpu.json

Runs two processes, one per GPU (rank 0 = trainer on cuda:0, rank 1 = rollout on cuda:1), NCCL, NVLink multicast off.

1. Weight-update latency through `precision_dsl.backends.weight_update` (TorchDistributedTransport over NCCL): the trainer
   quantizes its BF16 weights per plan on its GPU, packs buckets and broadcasts them; the rollout receives and checks
   the plan hash and per-tensor sha256 (check_equal). For the bundled tiny MoE and a 1.34B-parameter Qwen3-MoE-shaped
   model, under a BF16 plan and an NVFP4 per-token plan: wall time (quantize, transfer), bytes moved.
2. Converter equivalence: the bytes the rollout received (quantized on GPU 0) equal, tensor for tensor, the bytes
   `policyc convert` writes for the same weights on the CPU (bundled tiny MoE, every shipped format).
3. Expert-TP per-token NVFP4: the down_proj input of an expert is split along K across expert-TP ranks, so a
   per-token scale computed "inside the partition" depends on ETP. Trainer ETP=2 (each GPU quantizes its shard) vs
   rollout ETP=2 (identical bytes) vs rollout ETP=1 (one GPU quantizes whole rows): differing bytes and the error it
   causes in the down_proj output. `policyc check` refuses the unequal layout before launch (tests/test_commands.py).
Results are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = {
    "bf16": ROOT / "policies" / "bf16.policy",
    "nvfp4-pertoken": ROOT / "policies" / "nvfp4-pertoken-dequant-backward.policy",
    "mxfp8": ROOT / "policies" / "mxfp8-e2e.policy",
}
# ~1.34B parameters, Qwen3-MoE shaped (24 layers, 32 experts of 512, hidden 1024, vocab 32k).
MOE_1B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
    "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 32, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "vocab_size": 32768, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "attention_bias": False,
}


def _digest(t) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy()).hexdigest()


def _weights(arch, device, seed=0):
    """Trainer weights: the bundled checkpoint when there is one, else seeded random BF16 (scaled like an init)."""
    import torch
    from safetensors.torch import load_file

    ckpt = Path(arch.name) / "model.safetensors" if Path(arch.name).is_dir() else None
    bundled = ROOT / "precision_dsl" / "models" / arch.name / "model.safetensors"
    for p in (ckpt, bundled):
        if p is not None and p.is_file():
            return {k: v.to(device) for k, v in load_file(str(p)).items()}
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for t in arch.tensors:
        if t.role.startswith("norm"):
            out[t.hf_name] = torch.ones(t.shape, dtype=torch.bfloat16, device=device)
        else:
            out[t.hf_name] = (torch.randn(t.shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return out


def weight_update_latency(rank, dev, results, reps=3, big=True):
    import torch
    import torch.distributed as dist

    from precision_dsl.backends.weight_update import TorchDistributedTransport, WeightReceiver, WeightSender
    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(MOE_1B))
    for model in ("tiny-moe", str(tmp)) if big else ("tiny-moe",):
        arch = load_architecture(model)
        label = "tiny-moe" if model == "tiny-moe" else "qwen3-moe-1.3b (synthetic)"
        weights = _weights(arch, dev) if rank == 0 else None
        for pname in ("bf16", "nvfp4-pertoken"):
            plan = resolve(POLICIES[pname], arch)
            times, qtimes, nbytes = [], [], 0
            for rep in range(reps + 1):  # first rep = warm-up (NCCL communicator, caching allocator)
                transport = TorchDistributedTransport(device=dev)
                dist.barrier()
                _sync(dev)
                t0 = time.perf_counter()
                if rank == 0:
                    # timing without the optional per-tensor sha256 (a debug check on the host, like Miles'
                    # --check-weight-update-equal); converter_equivalence() runs the checked path
                    sender = WeightSender(plan, transport, bucket_bytes=256 << 20, check_equal=False)
                    tq = time.perf_counter()
                    units = list(sender.quantize_all(weights.items()))
                    _sync(dev)
                    qt = time.perf_counter() - tq
                    del units
                    report = sender.send(weights.items(), weight_version=f"v{rep}")
                    nbytes = report.bytes
                else:
                    WeightReceiver(plan, transport, check_equal=False).receive_raw()
                    qt = 0.0
                _sync(dev)
                dist.barrier()
                if rep:
                    times.append(time.perf_counter() - t0 - qt)  # send() re-quantizes: subtract the quantize-only time
                    qtimes.append(qt)
            if rank == 0:
                n_params = sum(t.numel for t in arch.tensors)
                row = {"model": label, "params": n_params, "policy": pname, "bytes_moved": nbytes,
                       "bf16_bytes": 2 * n_params, "update_s_median": sorted(times)[len(times) // 2],
                       "quantize_s_median": sorted(qtimes)[len(qtimes) // 2]}
                results["weight_update"].append(row)
                print(f"[update] {label:28s} {pname:15s} {nbytes / 1e6:9.1f} MB moved  "
                      f"(bf16 {2 * n_params / 1e6:9.1f} MB)  quantize {row['quantize_s_median'] * 1e3:8.1f} ms  "
                      f"quantize+pack+transfer {row['update_s_median'] * 1e3:8.1f} ms", flush=True)


def converter_equivalence(rank, dev, results):
    import torch.distributed as dist

    from precision_dsl.backends.converter import convert
    from precision_dsl.backends.weight_update import TorchDistributedTransport, WeightReceiver, WeightSender
    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    arch = load_architecture("tiny-moe")
    src = ROOT / "precision_dsl" / "models" / "tiny-moe"
    weights = _weights(arch, dev) if rank == 0 else None
    for pname in ("nvfp4-pertoken", "mxfp8", "bf16"):
        plan = resolve(POLICIES[pname], arch)
        transport = TorchDistributedTransport(device=dev)
        if rank == 0:
            WeightSender(plan, transport, check_equal=True).send(weights.items())
            got = None
        else:
            raw = WeightReceiver(plan, transport, check_equal=True).receive_raw()
            got = {n: _digest(t) for n, t in raw.items()}
        box = [got]
        dist.broadcast_object_list(box, src=1)
        if rank == 0:
            from safetensors.torch import load_file

            with tempfile.TemporaryDirectory() as d:
                out = Path(d) / "converted"
                convert(src, plan, out)
                conv = {}
                for f in sorted(out.glob("*.safetensors")):
                    conv.update({n: _digest(t) for n, t in load_file(str(f)).items()})
            received = box[0]
            differing = sorted(n for n in conv if received.get(n) != conv[n])
            missing = sorted(set(conv) ^ set(received))
            row = {"policy": pname, "tensors": len(conv), "differing": len(differing), "name_mismatch": len(missing),
                   "first_differing": differing[:3]}
            results["converter_equivalence"].append(row)
            print(f"[convert==update] tiny-moe {pname:15s} {len(conv)} tensors, {len(differing)} differing bytes-wise,"
                  f" {len(missing)} name mismatches", flush=True)


def etp_pertoken(rank, dev, results, tokens=8192, inter=768, hidden=2048):
    """Per-token NVFP4 scales of a row-parallel (expert-TP) down_proj input, computed inside each partition."""
    import torch
    import torch.distributed as dist

    from precision_dsl.formats import nvfp4

    g = torch.Generator(device=dev).manual_seed(1234)  # same full tensors on both ranks
    # activations with a few strong channels per token (as SwiGLU outputs have), bf16
    x = torch.randn(tokens, inter, generator=g, device=dev)
    x = x * torch.exp(torch.randn(1, inter, generator=g, device=dev) * 0.75)
    x = x.to(torch.bfloat16)
    w = (torch.randn(hidden, inter, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    shard = inter // 2
    xs = x[:, rank * shard:(rank + 1) * shard].contiguous()
    q = nvfp4.quantize(xs, scope="row")
    deq = nvfp4.dequantize(q, torch.float32)
    partial = deq @ w[:, rank * shard:(rank + 1) * shard].float().t()
    dist.all_reduce(partial)  # row-parallel down_proj: sum of partial products over the ETP group
    datas = [torch.empty_like(q.data) for _ in range(2)]
    dist.all_gather(datas, q.data)
    if rank == 0:
        trainer_bytes = torch.cat(datas, dim=1)
        # rollout with ETP=2: the same partition -> quantized on its own GPU again
        again = torch.cat([nvfp4.quantize(x[:, r * shard:(r + 1) * shard].contiguous(), scope="row").data
                           for r in range(2)], dim=1)
        # rollout with ETP=1: one GPU, per-token scale over the whole row
        q1 = nvfp4.quantize(x, scope="row")
        y1 = nvfp4.dequantize(q1, torch.float32) @ w.float().t()
        y_ref = x.float() @ w.float().t()
        diff_bytes = float((trainer_bytes != q1.data).float().mean())
        rel = float((partial - y1).norm() / y1.norm())
        err2 = float((partial - y_ref).norm() / y_ref.norm())
        err1 = float((y1 - y_ref).norm() / y_ref.norm())
        row = {"tokens": tokens, "moe_intermediate": inter, "hidden": hidden,
               "etp2_vs_etp2_identical": bool(torch.equal(trainer_bytes, again)),
               "etp2_vs_etp1_fraction_bytes_differing": diff_bytes,
               "etp2_vs_etp1_output_rel_diff": rel, "etp2_quant_rel_err": err2, "etp1_quant_rel_err": err1}
        results["etp_pertoken"] = row
        print(f"[etp] trainer ETP=2 vs rollout ETP=2: identical={row['etp2_vs_etp2_identical']}; vs rollout ETP=1: "
              f"{100 * diff_bytes:.1f}% of data bytes differ, down_proj output rel. diff {rel:.2e} "
              f"(each side's own quantization error vs BF16: {err2:.2e} / {err1:.2e})", flush=True)


def _sync(dev: str) -> None:
    import torch

    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def worker(rank: int, world: int, out: str, port: int, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if cpu:  # logic check of this script on a CPU machine (gloo); no timing claims from it
        dev = "cpu"
        dist.init_process_group("gloo", rank=rank, world_size=world)
        name = "cpu (gloo dry run)"
    else:
        dev = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(dev))
        name = torch.cuda.get_device_name(rank)
    results = {"device": name, "torch": torch.__version__, "weight_update": [], "converter_equivalence": []}
    try:
        converter_equivalence(rank, dev, results)
        etp_pertoken(rank, dev, results, tokens=512 if cpu else 8192)
        weight_update_latency(rank, dev, results, reps=1 if cpu else 2, big=not cpu)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0 and out:
        Path(out).write_text(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--cpu", action="store_true", help="dry-run the logic on CPU with gloo (no GPU numbers)")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("two_gpu.py needs 2 GPUs (run it on nvidia-h200-x2), or --cpu for a logic dry run")
    mp.spawn(worker, args=(2, args.out, args.port, args.cpu), nprocs=2, join=True)


if __name__ == "__main__":
    main()
