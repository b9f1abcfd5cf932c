"""Weight-update latency on ONE H200: trainer weights on cuda:0 -> rollout-owned buffers on cuda:0 (colocated).

    source benchmarks/device_setup.sh && python3 benchmarks/weight_update_gpu.py --reps 3 --out $OUT/wu.json

Modes, side by side in one run (same weights, same receiver); any of them "<mode>/bucket": a CUDA graph per bucket
and lane instead of one graph of the whole update (backends/update_program.py UpdateProgram._capture_whole), or
"<mode>/hi=copy" / "/hi=none": the whole-update graph's copy lane on the high-priority stream / neither lane:
  * direct (the default colocated path): InProcessTransport(persistent=True) hands out the receiver's own bucket
    buffers and the program quantizes / packs straight into them (no pool buffer, no second copy), NVFP4 by
    seg_amax + nvfp4_segment, a bucket's small high-precision pieces in one launch;
  * direct-serial: the same with every launch on one stream (the default runs the copies of the high-precision
    pieces beside the quantize launches, on two streams: backends/update_program.py UpdateProgram.run);
  * direct-segments: the same kernels with a launch per segment instead of one per bucket (kernels/
    triton_bucket.py: a bucket's NVFP4 segments in one predicted launch + one redo + one roll, its MXFP8 inputs in
    one launch);
  * direct-items / direct-fused / direct-tiles: the same with that NVFP4 segment kernel (backends/update_program.py
    NVFP4_KERNELS; the default is "predicted": one read quantizes with the previous update's group amaxes and only
    groups whose amax changed are redone - its worst case, every group changed, is timed too and printed beside
    the row; the flat item pair; the one-pass kernel; the row-tile pair);
  * copy (the previous program): the sender fills two pool buffers, a copy stream moves them into the receiver's
    buffers (direct=False), NVFP4 by seg_amax + nvfp4_segment, a launch per small piece.
Per model it prints the BF16 update, NVFP4 / MXFP8 as x the BF16 update and x a bare copy of their bytes,
quantize-only, launches per update (CUDA kernels + memsets counted by the torch profiler, and per bucket) and the
verdicts against the colocated-update goals (<= 0.8x BF16; NVFP4 <= 3x, MXFP8 <= 2x bare). For the 1.34B model the
three policies' updates are then also timed round-robin (`--interleave` rounds), so a drift of clocks or HBM between
the separate measurements cannot move their ratios. `--time-limit` stops starting
new measurements after that many seconds (what was measured is written); the 30B-shaped model steps its layer
count down on OOM.

"The link" is HBM itself (trainer and rollout share the GPU); the limit each update is compared with is a bare
copy of the SAME bytes, same bucket sizes, into the same receiver buffers through the same transport, measured in
the same run. Models: the 1.34B Qwen3-MoE-shaped model of two_gpu.py and a Qwen3-30B-A3B-shaped one (hidden 2048,
128 experts of 768, 32/4 heads of 128, vocab 151936; `--layers`, default 48 = the real depth, fewer on OOM), random
BF16 weights. Expert weights live in per-layer grouped buffers ([E, 2N, K] fc1 = gate_e/up_e, [E, H, N] fc2) like
Megatron's grouped experts, so the update program stacks them without copies. Per row:
  * update    = WeightSender.send(prepared) + WeightReceiver.receive_raw of the rollout's one kept receiver, median
                (sender without check_equal: direct mode runs no fingerprint pass, copy mode samples 1/16 of the
                bytes); a check_equal update (every byte fingerprinted) runs after the timings, not timed;
  * quantize  = the program with a no-op transport (its own pool buffers);
  * bare copy = the same bytes copied bucket by bucket through the same transport.
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


GOALS = {"nvfp4": (0.8, 3.0), "mxfp8": (0.8, 2.0)}  # (x the BF16 update, x a bare copy of its bytes)


def summarize_vs_bf16(label: str, rows: dict, limit: str) -> None:
    """Goal 1's two ratios per quantized policy (rows by policy): its update over BF16's (stored in the row) and
    over the link limit measured beside it (`limit`: "bare copy" / "bare broadcast"), with the verdicts."""
    for p in ("nvfp4", "mxfp8"):
        r = rows.get(p)
        if r is None or "bf16" not in rows:
            print(f"[{label}] {p}: not measured (time limit or OOM)", flush=True)
            continue
        r["vs_bf16_update"] = r["update_s"] / rows["bf16"]["update_s"]
        g_bf16, g_bare = GOALS[p]
        r["goal_met"] = r["vs_bf16_update"] <= g_bf16 and r["update_over_bare"] <= g_bare
        print(f"[{label}] {p}: {r['vs_bf16_update']:.2f}x the BF16 update (goal <= {g_bf16}: "
              f"{'met' if r['vs_bf16_update'] <= g_bf16 else 'NOT met'}), {r['update_over_bare']:.2f}x {limit} of "
              f"its bytes (goal <= {g_bare}: {'met' if r['update_over_bare'] <= g_bare else 'NOT met'})", flush=True)


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


def _gpu_profile(fn) -> tuple:
    """(launches, GPU span s, GPU busy s) of one call, from the torch profiler's CUDA activity: kernels + memsets +
    memcpys (kernels replayed from CUDA graphs included); first start to latest end; the union of their intervals
    (span - busy: gaps between kernels; an update's wall time - span: host time before its first kernel and after
    its last). (-1, None, None) when the profiler cannot trace here: the timings stand without them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except Exception as err:
        print(f"  (GPU profile unavailable: {type(err).__name__}: {str(err)[:80]})", flush=True)
        return -1, None, None
    iv = sorted((e.time_range.start, e.time_range.end) for e in events if e.time_range.end > e.time_range.start)
    if not iv:
        return len(events), None, None
    busy, (cs, ce) = 0, iv[0]
    for s, e in iv[1:]:
        if s > ce:
            busy, cs, ce = busy + ce - cs, s, e
        else:
            ce = max(ce, e)
    busy += ce - cs
    return len(events), (ce - iv[0][0]) * 1e-6, busy * 1e-6  # ce: the latest end of all


HOST_PROFILE = False  # --host-profile
HOST_SPLIT = False  # --host-split
TRACE_DIR = None  # --trace


def _host_split(update, bound, reps) -> dict:
    """Where an update's wall time goes around its one graph launch, without a profiler: the host time from the
    update's start to the cudaGraphLaunch call, the call itself, the graph's GPU time (CUDA events around it on the
    launching stream) and the host time from the call's return to the update's end (the wait for the GPU, the
    receive). Medians over reps updates."""
    import torch

    g = bound.whole
    marks: dict = {}
    replay = g.replay

    def timed_replay():
        marks["e0"].record()
        marks["t1"] = time.perf_counter()
        replay()
        marks["t2"] = time.perf_counter()
        marks["e1"].record()

    g.replay = timed_replay
    rows = []
    try:
        for _ in range(reps):
            marks["e0"], marks["e1"] = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            update()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            rows.append(((marks["t1"] - t0) * 1e6, (marks["t2"] - marks["t1"]) * 1e6,
                         marks["e0"].elapsed_time(marks["e1"]) * 1e3, (t3 - marks["t2"]) * 1e6, (t3 - t0) * 1e6))
    finally:
        del g.replay
    keys = ("pre_launch_us", "launch_call_us", "graph_gpu_us", "post_launch_us", "update_us")
    return {k: statistics.median(r[i] for r in rows) for i, k in enumerate(keys)}


class _Clock:
    def __init__(self, limit_s):
        self.t0, self.limit_s = time.perf_counter(), limit_s

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.limit_s


def _measure(label, pname, plan, weights, mode, reps, bucket_mb, kernels, keep=None):
    """One mode's update row: median update (send + receive_raw), quantize-only, launches; the receiver's
    buffers are released before returning (the 48-layer model holds one received copy at a time), unless `keep`
    (a dict) is given: then keep[pname] = the update function, its sender and receiver kept alive for the
    interleaved timing (bench_model)."""
    import torch

    from precision_dsl.backends.weight_update import (InProcessTransport, PreparedUpdate, WeightReceiver,
                                                      WeightSender)

    full_mode = mode
    # "<mode>/bucket": a CUDA graph per bucket, not one per update; "<mode>/hi=<lane>": that lane of the whole-update
    # graph on the high-priority stream (quant, copy or none)
    mode, *graph_opts = mode.split("/")
    direct = mode.startswith("direct")
    tr = InProcessTransport(persistent=True, direct=direct)
    t0 = time.perf_counter()
    sender = WeightSender(plan, tr, bucket_bytes=bucket_mb << 20)
    prog = sender.program()
    t_prog = time.perf_counter() - t0
    t0 = time.perf_counter()
    prep = sender.prepare_program(weights.items())
    if mode not in ("direct", "direct-serial"):
        # direct-<kernel>: that NVFP4 segment kernel; copy: the previous program (copy into the receiver, a launch
        # per small piece, the row-tile NVFP4 kernels)
        kernel = mode.split("-", 1)[1] if mode.startswith("direct-") else "tiles"
        per_segment = kernel == "segments"  # the default kernels, a launch (NVFP4: four) per segment
        prep = PreparedUpdate(prog.bind(prep.tensors, group_small=direct,
                                        nvfp4_kernel="predicted" if per_segment else kernel,
                                        bucket_launches=not per_segment and mode.startswith("direct-")),
                              prep.tensors)
    if mode == "direct-serial":  # every launch on one stream, bucket after bucket (no lanes)
        prep.bound.lanes = False
    for opt in graph_opts:
        if opt == "bucket":
            prep.bound.whole_graph = False
        elif opt.startswith("hi="):
            prep.bound.high_lane = opt[3:]
        else:
            raise SystemExit(f"unknown mode option /{opt} (bucket, hi=quant|copy|none)")
    t_bind = time.perf_counter() - t0
    rx = WeightReceiver(plan, tr, check_equal=False)  # the rollout's one receiver, kept across updates
    holder = {}

    phases: list = []

    def update():
        holder.pop("raw", None)
        t0 = time.perf_counter()
        sender.send(prep)  # returns after the update's one host synchronisation (every bucket filled)
        t1 = time.perf_counter()
        holder["raw"] = rx.receive_raw()
        phases.append((t1 - t0, time.perf_counter() - t1))

    update()  # warm-up: Triton compilation, allocator, receiver layout check
    update()  # captures the per-bucket CUDA graphs
    phases.clear()
    med, ts = _timed(update, reps)
    send_s = statistics.median(p[0] for p in phases)
    recv_s = statistics.median(p[1] for p in phases)
    launches, span, busy = _gpu_profile(update)
    if TRACE_DIR is not None:  # every kernel of one update with its stream (chrome trace), for the gaps
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            update()
            torch.cuda.synchronize()
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(TRACE_DIR / f"{label.split()[0]}_{pname}_{full_mode.replace('/', '_').replace('=', '_')}.json"))
    # the predicted NVFP4 kernel's worst case: every group amax differs from the last update's (all redone); its
    # kept amaxes are invalidated before each timed update (outside the timing)
    states = [st["prev_bits"] for st in prep.bound.seg_state.values() if "prev_bits" in st]
    med_redo = None
    if states:
        tr_ = []
        for _ in range(reps):
            for st in states:
                st.fill_(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            update()
            torch.cuda.synchronize()
            tr_.append(time.perf_counter() - t0)
        med_redo = statistics.median(tr_)
    qprog = WeightSender(plan, _Null(), bucket_bytes=bucket_mb << 20)
    qprog._program = prog
    qprog.send(prep)
    med_q, _ = _timed(lambda: qprog.send(prep), reps)
    if HOST_PROFILE:  # where the host time of an update goes (per update, own time)
        import cProfile
        import pstats

        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            update()
        pr.disable()
        st = pstats.Stats(pr)
        rows_ = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:10]
        print(f"[{label}] {pname} {mode} host per update: total {st.total_tt / 20 * 1e3:.3f} ms; " + "; ".join(
            f"{Path(f).name}:{ln} {fn} {tt / 20 * 1e6:.0f} us" for (f, ln, fn), (_, _, tt, _, _) in rows_), flush=True)
    if kernels:  # where the GPU time of one update goes, per kernel (torch profiler, CUDA activity)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            update()
            torch.cuda.synchronize()
        ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
        print(f"[{label}] {pname} {mode} kernels: " + "; ".join(
            f"{e.key[:48]} x{e.count} {e.device_time_total / 1e3:.1f} ms" for e in ka), flush=True)
    # bare copy of the same bytes, same buckets, into the same receiver buffers through the same transport
    src = torch.empty(prog.max_bucket, dtype=torch.uint8, device=weights[next(iter(weights))].device).random_(0, 255)
    sizes = [b.nbytes for b in prog.buckets]

    def bare():
        tr._k = 0  # what open() does: bucket k lands in receiver buffer k
        bufs = [tr.send_gpu_bucket({}, src[:n]) for n in sizes]
        got = [tr.recv() for _ in sizes]
        del bufs, got

    bare()
    med_bare, _ = _timed(bare, reps)
    del src
    # the check_equal update (every byte fingerprinted when filled and again on receipt), not timed
    s2 = WeightSender(plan, tr, bucket_bytes=bucket_mb << 20, check_equal=True)
    s2._program = prog
    holder.clear()
    rx.raw = {}
    s2.send(prep)
    WeightReceiver(plan, tr, check_equal=True).receive_raw()
    n_seg = sum(len(b.segments) for b in prog.buckets)
    row = {"model": label, "policy": pname, "mode": full_mode, "bytes": prog.bytes, "wire_bytes": sum(sizes),
           "buckets": len(prog.buckets), "tensors_out": prog.tensors, "segments": n_seg,
           "zero_copy": prep.bound.gathers == 0, "program_build_s": t_prog, "bind_s": t_bind, "update_s": med,
           "update_all_s": ts, "quantize_s": med_q, "bare_copy_s": med_bare, "update_over_bare": med / med_bare,
           "update_all_redone_s": med_redo, "launches_per_update": launches,
           "launches_per_bucket": launches / len(prog.buckets) if launches >= 0 else None,
           "fingerprints_checked": True, "send_s": send_s, "receive_s": recv_s, "gpu_span_s": span,
           "gpu_busy_s": busy}
    print(f"[{label}] {pname:6s} {full_mode:6s} {prog.bytes / 1e9:7.2f} GB  {n_seg:5d} segments  update "
          f"{med * 1e3:8.2f} ms  quantize {med_q * 1e3:7.2f} ms  bare copy {med_bare * 1e3:7.2f} ms  "
          f"x{med / med_bare:4.2f} of bare  (send {send_s * 1e3:.2f} + receive {recv_s * 1e3:.2f}; GPU span "
          f"{(span or 0) * 1e3:.2f}, busy {(busy or 0) * 1e3:.2f})  launches {launches} ({row['launches_per_bucket'] or 0:.1f}/bucket, "
          f"{len(prog.buckets)} buckets)" + (f"  [every NVFP4 group amax changed: {med_redo * 1e3:.2f} ms = "
                                             f"x{med_redo / med_bare:4.2f} of bare]" if med_redo else ""), flush=True)
    if HOST_SPLIT and prep.bound.whole is not None:
        h = row["host_split"] = _host_split(update, prep.bound, reps)
        print(f"[{label}] {pname} {full_mode} host split (median of {reps}, us): update start -> graph launch "
              f"{h['pre_launch_us']:.0f}, cudaGraphLaunch {h['launch_call_us']:.0f}, graph on the GPU "
              f"{h['graph_gpu_us']:.0f}, launch return -> update end {h['post_launch_us']:.0f}, update "
              f"{h['update_us']:.0f}", flush=True)
    if keep is not None:
        keep[pname] = update
        return row
    rx.raw = {}
    holder.clear()
    tr._dst.clear()
    del sender, prep, qprog, s2, rx, tr
    torch.cuda.empty_cache()
    return row


SWEEP = {"items": [dict()], "fused": [dict()]}  # their launch shapes were swept in sessions 15-16 (RESULTS.md)
PREDICTED_SWEEP = [dict(), dict(item_blocks=256, num_warps=4), dict(item_blocks=512, num_warps=4),
                   dict(item_blocks=128, num_warps=1), dict(item_blocks=256, num_warps=2),
                   dict(item_blocks=64, num_warps=1), dict(item_blocks=512, num_warps=8),
                   dict(item_blocks=1024, num_warps=8)]


def kernel_sweep(results, reps=5) -> None:
    """NVFP4 segment kernels alone on the 30B-shaped model's expert segments (one layer: gate/up 128 x [1536, 2048]
    with gate+up share-scale groups, down 128 x [2048, 768]) and the 1.34B model's (32 x [1024, 1024], 32 x
    [1024, 512]): the row-tile pair (seg_amax + nvfp4_segment), the item pair and the one-pass kernel at several
    launch shapes, against a copy of the input in the same run; every variant's bytes against the row-tile pair's."""
    import torch

    from precision_dsl.kernels import triton_segments as ks

    shapes = (("30b gate_up", 768, 1536, 2048, 256), ("30b down", 2048, 2048, 768, 128),
              ("1.3b gate_up", 512, 1024, 1024, 64), ("1.3b down", 1024, 1024, 512, 32))
    for name, rpm, rpg, k, members in shapes:
        m = rpm * members
        x = (torch.randn(m, k, device="cuda") * 0.02).to(torch.bfloat16)
        outs = lambda: (torch.empty(m, k // 2, dtype=torch.uint8, device="cuda"),  # noqa: E731
                        torch.empty(m, k // 16, dtype=torch.uint8, device="cuda"),
                        torch.empty(m // rpm, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
                        torch.empty(m // rpm, device="cuda"))
        d0, s0, g0, b0, _ = outs()

        def tiles():
            bits = torch.zeros(m // rpg, dtype=torch.int32, device="cuda")
            ks.seg_amax(x, rpg, bits, b0)
            ks.nvfp4_segment(x, bits.view(torch.float32), rpg, rpm, d0, s0, g0)

        tiles()
        t_tiles, _ = _timed(tiles, reps)
        y = torch.empty_like(x)
        y.copy_(x)
        t_copy, _ = _timed(lambda: y.copy_(x), reps)
        del y
        print(f"[sweep {name}] {x.numel() * 2 / 1e6:.0f} MB bf16: copy {t_copy * 1e3:.3f} ms, row tiles "
              f"{t_tiles * 1e3:.3f} ms ({t_copy / t_tiles:.0%} of copy)", flush=True)
        results.append({"sweep": name, "kernel": "tiles", "config": {}, "s": t_tiles, "copy_s": t_copy})
        for kernel, cfgs in SWEEP.items():
            fn = ks.nvfp4_segment_items if kernel == "items" else ks.nvfp4_segment_fused
            for cfg in cfgs:
                d1, s1, g1, b1, isc = outs()
                run = lambda: fn(x, rpg, rpm, d1, s1, g1, b1, isc, **cfg)  # noqa: E731
                try:
                    run()
                    t, _ = _timed(run, reps)
                except Exception as err:  # a launch shape this GPU refuses: reported, the sweep goes on
                    print(f"[sweep {name}] {kernel} {cfg}: failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                same = torch.equal(d0, d1) and torch.equal(s0, s1) and torch.equal(g0.view(torch.int32),
                                                                                   g1.view(torch.int32))
                print(f"[sweep {name}] {kernel} {cfg or 'default'}: {t * 1e3:.3f} ms ({t_copy / t:.0%} of copy, "
                      f"{t_tiles / t:.2f}x row tiles), bytes {'same' if same else 'DIFFER'}", flush=True)
                results.append({"sweep": name, "kernel": kernel, "config": dict(cfg), "s": t, "copy_s": t_copy,
                                "tiles_s": t_tiles, "same_bytes": same})
        for cfg in PREDICTED_SWEEP:
            d1, s1, g1, b1, isc = outs()
            prev = torch.full((m // rpg,), -1, dtype=torch.int32, device="cuda")
            pred = lambda c=cfg: ks.nvfp4_segment_predicted(x, rpg, rpm, d1, s1, g1, b1, prev, isc, **c)  # noqa: E731
            pred()
            t_pred, _ = _timed(pred, reps)  # steady state: the weights (hence every group amax) as in the last call
            same = torch.equal(d0, d1) and torch.equal(s0, s1) and torch.equal(g0.view(torch.int32),
                                                                               g1.view(torch.int32))
            t_worst, _ = _timed(lambda: (prev.fill_(-1), pred()), reps)  # every group redone
            print(f"[sweep {name}] predicted {cfg or 'default'}: {t_pred * 1e3:.3f} ms ({t_copy / t_pred:.0%} of copy, "
                  f"{t_tiles / t_pred:.2f}x row tiles) with every group amax as predicted, {t_worst * 1e3:.3f} ms "
                  f"({t_copy / t_worst:.0%}) with none, bytes {'same' if same else 'DIFFER'}", flush=True)
            results.append({"sweep": name, "kernel": "predicted", "config": dict(cfg), "s": t_pred,
                            "all_redone_s": t_worst, "copy_s": t_copy, "tiles_s": t_tiles, "same_bytes": same})
        print(f"[sweep] resident programs per SM of the one-pass kernel: {ks._RESIDENT}", flush=True)
        del x
        torch.cuda.empty_cache()


def _measured_with_shape(label, pname, plan, weights, mode, reps, bucket_mb, kernels, keep=None):
    """_measure; a mode "<mode>@<item blocks>x<warps>[r<registers>]" runs <mode> with that launch shape of the
    predicted NVFP4 kernel (triton_segments.PREDICTED_ITEM_BLOCKS / PREDICTED_NUM_WARPS, PREDICTED_MAXNREG) instead
    of the default, side by side; "<mode>~<blocks>x<warps>" with that launch shape of the flat rowwise MXFP8 kernel
    (triton_mxfp8.ROW_ITEM_BLOCKS / ROW_NUM_WARPS), "<mode>~screen" / "<mode>~count" with its NaN/Inf count taken
    on the block max (triton_mxfp8.ROW_AMAX_SCREEN = True, the default) / element by element (False)."""
    from precision_dsl.kernels import triton_mxfp8 as kmx
    from precision_dsl.kernels import triton_segments as ks

    if "~" in mode:
        base, _, shape = mode.partition("~")
        saved_mx = kmx.ROW_ITEM_BLOCKS, kmx.ROW_NUM_WARPS, kmx.ROW_AMAX_SCREEN
        if shape in ("screen", "count"):
            kmx.ROW_AMAX_SCREEN = shape == "screen"
        else:
            kmx.ROW_ITEM_BLOCKS, kmx.ROW_NUM_WARPS = (int(v) for v in shape.split("x"))
        try:
            row = _measured_with_shape(label, pname, plan, weights, base, reps, bucket_mb, kernels, keep)
        finally:
            kmx.ROW_ITEM_BLOCKS, kmx.ROW_NUM_WARPS, kmx.ROW_AMAX_SCREEN = saved_mx
        row["mode"] = mode
        return row
    base, _, shape = mode.partition("@")
    if not shape:
        return _measure(label, pname, plan, weights, mode, reps, bucket_mb, kernels, keep)
    saved = ks.PREDICTED_ITEM_BLOCKS, ks.PREDICTED_NUM_WARPS, ks.PREDICTED_MAXNREG
    shape, _, regs = shape.partition("r")
    ks.PREDICTED_ITEM_BLOCKS, ks.PREDICTED_NUM_WARPS = (int(v) for v in shape.split("x"))
    ks.PREDICTED_MAXNREG = int(regs) if regs else None
    try:
        row = _measure(label, pname, plan, weights, base, reps, bucket_mb, kernels, keep)
    finally:
        ks.PREDICTED_ITEM_BLOCKS, ks.PREDICTED_NUM_WARPS, ks.PREDICTED_MAXNREG = saved
    row["mode"] = mode
    return row


def interleaved(label, mode, kept: dict, rows: dict, rounds: int) -> None:
    """The kept updates of one mode timed in rounds (BF16, NVFP4, MXFP8, BF16, ...), so that a drift of the GPU's
    clocks or of HBM between the separate measurements cannot move the ratios: each row gets update_interleaved_s
    and the quantized ones vs_bf16_interleaved. In a round each policy runs one untimed update, then two timed
    ones: timed one at a time round-robin, every 1.34B median came out ~0.15 ms above its back-to-back one (session
    19), a cost of switching between working sets that the back-to-back updates of a colocated run never pay."""
    ts: dict = {p: [] for p in kept}
    for _ in range(rounds):
        for p, fn in kept.items():
            fn()
            ts[p].extend(_timed(fn, 2)[1])
    med = {p: statistics.median(v) for p, v in ts.items()}
    for p, m in med.items():
        rows[p]["update_interleaved_s"] = m
        rows[p]["update_interleaved_all_s"] = ts[p]
    if "bf16" not in med:
        return
    parts = [f"bf16 {med['bf16'] * 1e3:.3f} ms"]
    for p in ("nvfp4", "mxfp8"):
        if p in med:
            r = rows[p]
            r["vs_bf16_interleaved"] = med[p] / med["bf16"]
            r["interleaved_over_bare"] = med[p] / r["bare_copy_s"]
            g_bf16, g_bare = GOALS[p]
            ok = r["vs_bf16_interleaved"] <= g_bf16 and r["interleaved_over_bare"] <= g_bare
            parts.append(f"{p} {med[p] * 1e3:.3f} ms = {r['vs_bf16_interleaved']:.2f}x BF16, "
                         f"{r['interleaved_over_bare']:.2f}x bare ({'met' if ok else 'NOT met'})")
    print(f"[{label} {mode}] interleaved, {rounds} rounds of 1 + 2 timed: " + "; ".join(parts), flush=True)


def bench_model(label, cfg, reps, bucket_mb, results, clock, kernels=False, modes=("direct", "copy"),
                interleave_rounds=0):
    import torch

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
    by_mode: dict = {m: {} for m in modes}
    kept: dict = {m: {} for m in modes}
    try:
        for pname, pfile in POLICIES.items():
            plan = resolve(ROOT / "policies" / f"{pfile}.policy", arch)
            for mode in modes:
                if clock.over():
                    print(f"[{label}] {pname} {mode}: skipped (time limit)", flush=True)
                    continue
                row = _measured_with_shape(label, pname, plan, weights, mode, reps, bucket_mb, kernels,
                                           kept[mode] if interleave_rounds else None)
                row["params"] = n_params
                by_mode[mode][pname] = row
                results.append(row)
        for mode in modes:
            if interleave_rounds and len(kept[mode]) > 1 and not clock.over():
                interleaved(label, mode, kept[mode], by_mode[mode], interleave_rounds)
    finally:
        kept.clear()
        del weights
        torch.cuda.empty_cache()
    for mode in modes:
        rows = by_mode[mode]
        if "bf16" in rows:
            b = rows["bf16"]
            print(f"[{label}] {mode}: BF16 update {b['update_s'] * 1e3:.2f} ms = {b['update_over_bare']:.2f}x bare "
                  f"copy; launches per update: " + ", ".join(f"{p} {r['launches_per_update']}"
                                                              for p, r in rows.items()), flush=True)
        summarize_vs_bf16(f"{label} {mode}", rows, "bare copy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("wu.json"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--skip-30b", action="store_true")
    ap.add_argument("--modes", default="direct,copy", help="comma list of: direct (the program's default), "
                    "direct-serial (every launch on one stream), direct-segments (a launch per segment), direct-items / direct-fused / direct-tiles (direct with that NVFP4 kernel), copy; "
                    "any of them @<item blocks>x<warps>[r<regs>] (e.g. direct@256x4, direct@256x2r96): with that "
                    "predicted-kernel launch shape (and ptx maxnreg); ~<blocks>x<warps> (e.g. direct~128x4): with "
                    "that launch shape of the flat rowwise MXFP8 kernel; ~screen / ~count: its NaN/Inf count on the block "
                    "max (the default) / element by element")
    ap.add_argument("--interleave", type=int, default=9, help="rounds of the 1.34B model's interleaved timing "
                    "(every policy's update kept, timed round-robin; 0: off; the 30B model's receivers do not fit "
                    "three at a time)")
    ap.add_argument("--time-limit", type=float, default=500.0, help="seconds; no new measurement starts after")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of 20 updates per row "
                    "(top functions by own time)")
    ap.add_argument("--host-split", action="store_true", help="per row with a whole-update graph: host time "
                    "before / in its launch, its GPU time and the rest of the update, without a profiler")
    ap.add_argument("--kernels", action="store_true", help="print the GPU time per kernel of one update")
    ap.add_argument("--trace", type=Path, default=None, help="a directory: per row, the chrome trace of one update "
                    "(every kernel with its stream)")
    ap.add_argument("--kernel-sweep", action="store_true",
                    help="first: the NVFP4 segment kernels' launch shapes side by side")
    args = ap.parse_args()
    import torch

    global HOST_PROFILE, TRACE_DIR, HOST_SPLIT
    HOST_PROFILE = args.host_profile
    HOST_SPLIT = args.host_split
    TRACE_DIR = args.trace
    clock = _Clock(args.time_limit)
    modes = tuple(m for m in args.modes.split(",") if m)
    results: list = []
    if args.kernel_sweep:
        kernel_sweep(results)
    bench_model("qwen3-moe-1.3b", MOE_1B, args.reps, args.bucket_mb, results, clock, args.kernels, modes,
                args.interleave)
    args.out.write_text(json.dumps(results, indent=1))
    if not args.skip_30b:
        layers = args.layers
        while layers >= 8 and not clock.over():
            try:
                bench_model(f"qwen3-30b-a3b-shaped ({layers} layers)", dict(QWEN3_30B, num_hidden_layers=layers),
                            max(3, args.reps - 2), args.bucket_mb, results, clock, args.kernels, modes)
                break
            except torch.cuda.OutOfMemoryError as err:
                print(f"OOM at {layers} layers: {str(err)[:120]}", flush=True)
                results[:] = [r for r in results if not r["model"].startswith("qwen3-30b")]
                torch.cuda.empty_cache()
                layers = layers * 3 // 4
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
