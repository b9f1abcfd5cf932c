"""Weight-update latency on ONE H200: trainer weights on cuda:0 -> rollout-owned buffers on cuda:0.

    source benchmarks/device_setup.sh && python3 benchmarks/weight_update_gpu.py --out $OUT/wu.json

No two-GPU machine is lent at the time of writing, so "the link" is a device-to-device copy on a second CUDA
stream of the same GPU (InProcessTransport.send_gpu_bucket: fresh receiver buffers, copy stream ordered after the
producer by events); the limit it is compared with is a bare copy of the SAME bytes, with the same bucket sizes,
through the same transport, measured in the same run. Models: the 1.34B Qwen3-MoE-shaped model of two_gpu.py and a
Qwen3-30B-A3B-shaped one (hidden 2048, 128 experts of 768, 32/4 heads of 128, vocab 151936; `--layers`, default 48
= the real depth, fewer on OOM), random BF16 weights. Expert weights live in per-layer grouped buffers
([E, 2N, K] fc1 = gate_e/up_e, [E, H, N] fc2) like Megatron's grouped experts, so the update program stacks them
without copies. Rows:
  * program   = WeightSender.send(prepared) + WeightReceiver.receive_raw (quantize, pack, copy, views), median;
                the rollout keeps one WeightReceiver, which checks the bucket layout against the plan on the first
                update only (recv of a new receiver is reported as "first update's recv"); sender without
                check_equal, so bucket fingerprints are sampled (1/16 of the bytes, see triton_segments.fingerprint);
                the check_equal run after the timings (every byte fingerprinted on both ends) is not timed;
  * send(items) = the same through the plain (name, tensor) API (binding per call: per-tensor Python);
  * per-unit  = the previous path (one quantize call per tensor / share group, host checks), 1.34B only;
  * quantize  = the program with a no-op transport;
  * bare copy = the same bytes copied bucket by bucket through the same transport.
The receiver's buffers persist across updates (InProcessTransport(persistent=True): the rollout overwrites its
weights in place); `--fresh` allocates new ones every update (what a receiver that keeps old updates pays).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = {"bf16": "bf16", "nvfp4": "nvfp4-pertoken-dequant-backward", "mxfp8": "mxfp8-e2e"}
BASE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "attention_bias": False}
MOE_1B = dict(BASE, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_experts=32,
              num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
              vocab_size=32768)
QWEN3_30B = dict(BASE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, vocab_size=151936)


def grouped_weights(arch, dev, seed=0):
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    out, experts = {}, {}
    for t in arch.tensors:
        if t.role.startswith("routed_experts."):
            experts.setdefault(t.layer, {}).setdefault(t.role, []).append(t)
        elif t.role.startswith("norm"):
            out[t.hf_name] = torch.ones(t.shape, dtype=torch.bfloat16, device=dev)
        else:
            out[t.hf_name] = (torch.randn(t.shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    for layer, roles in experts.items():
        gates = sorted(roles["routed_experts.gate"], key=lambda t: t.expert)
        ups = sorted(roles["routed_experts.up"], key=lambda t: t.expert)
        downs = sorted(roles["routed_experts.down"], key=lambda t: t.expert)
        n, k = gates[0].shape
        fc1 = torch.empty((len(gates), 2 * n, k), dtype=torch.bfloat16, device=dev)
        fc1.normal_(0, 0.02, generator=g)
        fc2 = torch.empty((len(downs),) + tuple(downs[0].shape), dtype=torch.bfloat16, device=dev)
        fc2.normal_(0, 0.02, generator=g)
        for e, (tg, tu, td) in enumerate(zip(gates, ups, downs)):
            out[tg.hf_name], out[tu.hf_name], out[td.hf_name] = fc1[e, :n], fc1[e, n:], fc2[e]
    return out


def summarize_vs_bf16(label: str, rows: dict, limit: str) -> None:
    """Goal 1's two ratios per quantized policy (rows by policy): its update over BF16's (stored in the row) and
    over the link limit measured beside it (`limit`: "bare copy" / "bare broadcast")."""
    for p in ("nvfp4", "mxfp8"):
        r = rows[p]
        r["vs_bf16_update"] = r["update_s"] / rows["bf16"]["update_s"]
        print(f"[{label}] {p}: {r['vs_bf16_update']:.2f}x the BF16 update, {r['update_over_bare']:.2f}x {limit} of its "
              f"bytes", flush=True)


class _Null:
    def open(self, h):
        pass

    def send_gpu_bucket(self, meta, buf):
        return None

    def close(self, s):
        pass


def _timed(fn, reps):
    import torch

    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def bench_model(label, cfg, reps, per_unit, bucket_mb, results, persistent=True, kernels=False):
    import torch

    from precision_dsl.backends.weight_update import InProcessTransport, WeightReceiver, WeightSender
    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    arch = load_architecture(str(tmp))
    dev = "cuda:0"
    t0 = time.perf_counter()
    weights = grouped_weights(arch, dev)
    torch.cuda.synchronize()
    n_params = sum(t.numel for t in arch.tensors)
    print(f"[{label}] {n_params / 1e9:.2f}B params, {len(arch.tensors)} tensors, weights made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    rows = {}
    for pname, pfile in POLICIES.items():
        plan = resolve(ROOT / "policies" / f"{pfile}.policy", arch)
        tr = InProcessTransport(persistent=persistent)
        t0 = time.perf_counter()
        sender = WeightSender(plan, tr, bucket_bytes=bucket_mb << 20)
        prog = sender.program()
        t_prog = time.perf_counter() - t0
        t0 = time.perf_counter()
        prep = sender.prepare_program(weights.items())
        t_bind = time.perf_counter() - t0
        n_seg = sum(len(b.segments) for b in prog.buckets)
        holder = {}
        rx = WeightReceiver(plan, tr, check_equal=False)  # the rollout's one receiver, kept across updates

        def update():
            holder.pop("raw", None)
            sender.send(prep)
            holder["raw"] = rx.receive_raw()

        update()  # warm-up: Triton compilation, allocator
        med, ts = _timed(update, reps)
        holder.clear()

        def update_items():
            holder.pop("raw", None)
            sender.send(weights.items())
            holder["raw"] = rx.receive_raw()

        med_items, _ = _timed(update_items, 1)
        holder.clear()
        qprog = WeightSender(plan, _Null(), bucket_bytes=bucket_mb << 20)
        qprog._program = prog
        med_q, _ = _timed(lambda: qprog.send(prep), reps)

        # bare copy of the same bytes, same buckets, same transport
        src = torch.empty(prog.max_bucket, dtype=torch.uint8, device=dev).random_(0, 255)
        sizes = [b.nbytes for b in prog.buckets]

        def bare():
            tr._k = 0  # what open() does: bucket k lands in receiver buffer k
            bufs = [tr.send_gpu_bucket({}, src[:n]) for n in sizes]
            got = [tr.recv() for _ in sizes]
            del bufs, got

        _timed(bare, 1)
        med_bare, _ = _timed(bare, reps)
        total = sum(sizes)
        part = min(total, 8 << 30)  # one large copy (GB/s reference), capped so the 30B-shaped model fits
        one = torch.empty(part, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(one)
        med_one, _ = _timed(lambda: dst.copy_(one), reps)
        med_one *= total / part
        del one, dst, src
        # where the time goes: sender alone (quantize + enqueue copies + the one sync), then the receiver
        t0 = time.perf_counter()
        sender.send(prep)
        torch.cuda.synchronize()
        t_send = time.perf_counter() - t0
        t0 = time.perf_counter()
        holder["raw"] = WeightReceiver(plan, tr, check_equal=False).receive_raw()  # a new receiver: first update
        torch.cuda.synchronize()
        t_recv_first = time.perf_counter() - t0
        holder.clear()
        sender.send(prep)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        holder["raw"] = rx.receive_raw()  # the kept receiver: layout already checked against the plan
        torch.cuda.synchronize()
        t_recv = time.perf_counter() - t0
        holder.clear()
        if kernels:  # where the GPU time of one update goes, per kernel (torch profiler, CUDA activity)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                update()
                torch.cuda.synchronize()
            holder.clear()
            ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]
            print(f"[{label}] {pname} kernels: " + "; ".join(
                f"{e.key[:48]} x{e.count} {e.device_time_total / 1e3:.1f} ms" for e in ka), flush=True)
        if pname == "nvfp4":
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            update()
            torch.cuda.synchronize()
            pr.disable()
            holder.clear()
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(8)
            print("\n".join(sio.getvalue().splitlines()[-14:]), flush=True)
        # check_equal run (GPU fingerprints), not timed; the persistent receiver buffers are released first so
        # that the 48-layer model still fits (weights + one received copy)
        rx.raw = {}  # the kept receiver's views hold the persistent buffers
        holder.clear()
        tr._dst.clear()
        torch.cuda.empty_cache()
        tr2 = InProcessTransport()
        s2 = WeightSender(plan, tr2, bucket_bytes=bucket_mb << 20, check_equal=True)
        s2._program = prog
        s2.send(prep)
        WeightReceiver(plan, tr2, check_equal=True).receive_raw()
        row = {"model": label, "params": n_params, "policy": pname, "receiver_buffers_persistent": persistent, "bytes": prog.bytes, "wire_bytes": total,
               "bf16_bytes": 2 * n_params, "buckets": len(prog.buckets), "tensors_out": prog.tensors,
               "segments": n_seg, "zero_copy": prep.bound.gathers == 0, "program_build_s": t_prog,
               "bind_s": t_bind, "update_s": med, "update_all_s": ts, "send_items_s": med_items,
               "quantize_s": med_q, "bare_copy_s": med_bare, "one_copy_s": med_one, "send_only_s": t_send,
               "receive_only_s": t_recv, "receive_first_update_s": t_recv_first,
               "update_over_bare": med / med_bare, "fingerprints_checked": True}
        if per_unit:
            tr3 = InProcessTransport()
            s3 = WeightSender(plan, tr3, bucket_bytes=bucket_mb << 20)

            def old():
                holder.pop("raw", None)
                s3.send_prepared(list(s3.quantize_all(weights.items())))  # the per-unit path, forced
                holder["raw"] = WeightReceiver(plan, tr3, check_equal=False).receive_raw()

            row["per_unit_s"] = _timed(old, 1)[0]
            holder.clear()
        rows[pname] = row
        results.append(row)
        print(f"[{label}] {pname:6s} {prog.bytes / 1e9:7.2f} GB  {n_seg:5d} segments  update {med * 1e3:8.1f} ms  "
              f"send(items) {med_items * 1e3:8.1f} ms  quantize {med_q * 1e3:7.1f} ms  bare copy {med_bare * 1e3:7.1f} "
              f"ms (one copy {med_one * 1e3:6.1f})  x{med / med_bare:4.2f} of bare  [send {t_send * 1e3:.1f} / "
              f"recv {t_recv * 1e3:.1f} ms, first update's recv {t_recv_first * 1e3:.1f} ms]"
              + (f"  per-unit {row['per_unit_s'] * 1e3:8.1f} ms" if per_unit else ""), flush=True)
        del sender, prep, qprog, s2
        torch.cuda.empty_cache()
    summarize_vs_bf16(label, rows, "bare copy")
    del weights
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("wu.json"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--skip-30b", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="fresh receiver buffers per update")
    ap.add_argument("--kernels", action="store_true", help="print the GPU time per kernel of one update")
    args = ap.parse_args()
    import torch

    results: list = []
    bench_model("qwen3-moe-1.3b", MOE_1B, args.reps, True, args.bucket_mb, results, not args.fresh)
    args.out.write_text(json.dumps(results, indent=1))
    if not args.skip_30b:
        layers = args.layers
        while layers >= 8:
            try:
                bench_model(f"qwen3-30b-a3b-shaped ({layers} layers)", dict(QWEN3_30B, num_hidden_layers=layers),
                            max(3, args.reps - 2), False, args.bucket_mb, results, not args.fresh, args.kernels)
                break
            except torch.cuda.OutOfMemoryError as err:
                print(f"OOM at {layers} layers: {str(err)[:120]}", flush=True)
                torch.cuda.empty_cache()
                layers = layers * 3 // 4
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
