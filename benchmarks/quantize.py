"""Quantize-kernel benchmark on one GPU (written for the H200): our fused Triton kernels vs the physical limit
(a device-to-device copy of the same bf16 input), our eager references and the best public implementations that
run on Hopper (torchao prototype.mx_formats; plain PyTorch per-token NVFP4 under torch.compile).

    python benchmarks/quantize.py [--shapes 8192x2048,16384x7168,4096x4096] [--no-sweep] [--json OUT.json]
                                  [--nvfp4-sweep 'row:chunk=64;2d:block_nb=32,k_major=True'] [--only-nvfp4]

Every NVFP4 launch config (kernels/triton_nvfp4.py ROW_CONFIGS / TENSOR_CONFIGS / TILE2D_CONFIGS / AMAX_CONFIGS, or
--nvfp4-sweep) is its own row, measured in the same run as the copy.

Timing (as perf_baseline.md): one CUDA graph runs the op over 2-8 distinct copies of the input (together >= 3x the
60 MB L2, so every call starts L2-cold), replayed 12 times, median per call; no host/launch overhead in the numbers.
Ops that synchronise with the host (our eager references) cannot be captured and use triton's do_bench instead
(marked [do_bench]: CUDA events, 256 MB L2 flush before every call, launch overhead included). The SM clock is
brought up with a short GEMM loop before measuring after idle periods. "bytes" = bytes the op must move at least:
the bf16 input read once + every output written once. GB/s = bytes / time; "% copy" = GB/s / GB/s of the copy
(copy bytes = 2 x input bytes, read + write). Peer ratios: peer time / our time (> 1 = we are faster).
torchao: carry a wheel and `pip install --no-deps` it; peers that fail to import/run are reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLT_MAX = 3.4028234663852886e38


_LAST = [0.0]


def _warm_gpu(seconds=0.3):
    """Bring the SM clock up (it idles at ~345 MHz on the H200 and ramps over ~1 s): the first shape of the
    first run was measured up to 2.5x slow without this, while torch.compile / Triton compilation left the GPU idle."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


L2_KEEP_ROWS = (0.25, 0.5, 0.75, 1.0)  # per_tensor(l2_keep=) rows of "nvfp4 per-tensor incl. amax"


def _graph_time(fn, xs, reps=12):
    """Median us per call of a CUDA graph that runs fn over every input in xs (distinct buffers, together larger
    than the 60 MB L2, so no call finds its input in L2); no host overhead in the timing (perf_baseline.md's
    method)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in xs:
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(xs))
    del graph
    times.sort()
    return times[len(times) // 2]


def _bench(fn, xs, use_graph=True, rep_ms=60):
    """(us per call, method). CUDA graph over the L2-cold input set; ops that synchronise with the host (our eager
    references check for NaN with .any()) cannot be captured and fall back to triton's do_bench (CUDA events, 256 MB
    L2 flush before every call), which includes their launch overhead - fair for eager code, which pays it too."""
    import torch
    from triton.testing import do_bench

    fn(xs[0])  # compile / autotune outside the timing
    if time.time() - _LAST[0] > 0.5:
        _warm_gpu()
    t = None
    if use_graph:
        try:
            t, method = _graph_time(fn, xs), "graph"
        except Exception:
            torch.cuda.synchronize()
    if t is None:
        t, method = do_bench(lambda: fn(xs[0]), warmup=10, rep=rep_ms, return_mode="median") * 1e3, "do_bench"
    _LAST[0] = time.time()
    return t, method


# ------------------------------------------------------------------------------------------------------- peers


def torch_per_token_nvfp4(x):
    """Straightforward PyTorch per-token NVFP4 (TE-like formulas, not bit-exact: plain `/`), a peer baseline."""
    import torch

    m, k = x.shape
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    s_enc = (2688.0 / amax).clamp(max=FLT_MAX)
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    s_dec = 1.0 / s_enc
    xb = xf.view(m, k // 16, 16)
    ab = xb.abs().amax(-1, keepdim=True)
    sf = (ab * (s_enc / 6.0).unsqueeze(-1)).clamp(max=448.0).to(torch.float8_e4m3fn)
    enc = (1.0 / (sf.float() * s_dec.unsqueeze(-1))).clamp(max=FLT_MAX)
    y = (xb * enc).clamp(-6.0, 6.0)
    a = y.abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
           + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    code = (idx + (y < 0).to(torch.uint8) * 8).view(m, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, sf.view(m, k // 16), s_dec


def _torchao():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    return to_mx, ScaleCalculationMode, nvfp4_quantize, per_tensor_amax_to_scale


# -------------------------------------------------------------------------------------------------- our configs

SWEEP = {
    "mxfp8_rowcol": [dict(split_ro=8, nkb=8, num_warps=4), dict(split_ro=8, nkb=4, num_warps=2),
                     dict(split_ro=8, nkb=16, num_warps=8), dict(split_ro=4, nkb=8, num_warps=4),
                     dict(split_ro=16, nkb=8, num_warps=4), dict(split_ro=None, group=1, nkb=8, num_warps=4)],
    "fp8_block_1x128": [dict(block_r=8, block_c=512, num_warps=4), dict(block_r=4, block_c=1024, num_warps=4),
                        dict(block_r=16, block_c=256, num_warps=8), dict(block_r=8, block_c=1024, num_warps=8)],
}


def nvfp4_configs(spec=None) -> dict:
    """{kind: [launch config, ...]} of the NVFP4 rows: the kernel module's tables (ROW_CONFIGS, TENSOR_CONFIGS,
    TILE2D_CONFIGS, AMAX_CONFIGS; {} = the wrapper's default), or `--nvfp4-sweep`
    "row:chunk=64,num_warps=2;2d:block_nb=32;amax:flat_block=0;..." (kinds row | tensor | 2d | amax; a kind left out
    keeps only its default)."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    if not spec:
        return {"row": list(knv.ROW_CONFIGS), "tensor": list(knv.TENSOR_CONFIGS), "2d": list(knv.TILE2D_CONFIGS),
                "amax": list(knv.AMAX_CONFIGS)}
    out = {"row": [{}], "tensor": [{}], "2d": [{}], "amax": [{}]}
    for item in filter(None, (i.strip() for i in spec.split(";"))):
        kind, _, rest = item.partition(":")
        cfg = {}
        for kv in filter(None, rest.split(",")):
            k, _, v = kv.partition("=")
            v = v.strip()
            cfg[k.strip()] = {"True": True, "False": False}[v] if v in ("True", "False") else int(v)
        if kind not in out:
            raise SystemExit(f"--nvfp4-sweep: unknown kind {kind!r} (row | tensor | 2d | amax)")
        if cfg not in out[kind]:
            out[kind].append(cfg)
    return out


def _with_amax_shape(cfg, fn):
    """fn() with triton_nvfp4's flat amax launch shape (AMAX_FLAT_BLOCK / AMAX_NUM_WARPS) set from cfg
    (flat_block / num_warps), so per_tensor's own PDL launch pair runs with it."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    saved = knv.AMAX_FLAT_BLOCK, knv.AMAX_NUM_WARPS
    knv.AMAX_FLAT_BLOCK = cfg.get("flat_block", saved[0])
    knv.AMAX_NUM_WARPS = cfg.get("num_warps", saved[1])
    try:
        return fn()
    finally:
        knv.AMAX_FLAT_BLOCK, knv.AMAX_NUM_WARPS = saved


def _label(cfg) -> str:
    return "default" if not cfg else ", ".join(f"{k}={v}" for k, v in cfg.items())


def _best(name, make_fn, configs, log, xs):
    best = None
    for cfg in configs:
        try:
            t, _ = _bench(make_fn(cfg), xs)
        except Exception as e:  # a config that does not compile (e.g. too many registers) is skipped
            log.append(f"{name} {cfg}: failed {type(e).__name__}: {str(e)[:200]}")
            continue
        log.append(f"{name} {cfg}: {t:.1f} us")
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def run_shape(m, k, sweep, log, nvfp4_cfgs=None, only_nvfp4=False):
    import torch

    from precision_dsl.formats import fp8_block, mxfp8, nvfp4
    from precision_dsl.kernels import triton_fp8_block as kfb
    from precision_dsl.kernels import triton_mxfp8 as kmx
    from precision_dsl.kernels import triton_nvfp4 as knv

    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
    n = m * k
    in_b = 2 * n
    # distinct copies of the input, together >= 3x the 60 MB L2, cycled through inside one CUDA graph
    xs = [x] + [x.clone() for _ in range(min(7, max(1, -(-180_000_000 // in_b) - 1)))]
    rows = []  # (group, label, us, bytes, kind) kind: copy | ours | ref | peer

    def add(group, label, fn, nbytes, kind):
        try:
            t, method = _bench(fn, xs, use_graph=kind not in ("ref",) and "eager" not in label)
            rows.append((group, label + ("" if method == "graph" else " [do_bench]"), t, nbytes, kind))
        except Exception as e:
            rows.append((group, label, None, nbytes, kind))
            log.append(f"{group} / {label}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")

    dst = torch.empty_like(x)
    add("copy", "device-to-device copy (x.copy_)", lambda t: dst.copy_(t), 2 * in_b, "copy")

    # ---- NVFP4: every launch config of the tables (or --nvfp4-sweep) is its own row, all in this run with the copy
    nv = nvfp4_cfgs or nvfp4_configs()
    b_tok = in_b + n // 2 + n // 16 + 8 * m
    for cfg in nv["row"]:
        add("nvfp4 per-token", f"ours (one pass) {_label(cfg)}", lambda t, c=cfg: knv.row_scaled(t, **c), b_tok, "ours")
    if not only_nvfp4:
        add("nvfp4 per-token", "our eager reference", lambda t: nvfp4.quantize(t, scope="row"), b_tok, "ref")
        add("nvfp4 per-token", "plain PyTorch, eager", lambda t: torch_per_token_nvfp4(t), b_tok, "peer")
        tok_c = torch.compile(torch_per_token_nvfp4, dynamic=False)
        add("nvfp4 per-token", "plain PyTorch, torch.compile", lambda t: tok_c(t), b_tok, "peer")

    # ---- NVFP4 per tensor (amax pass + quantize), and with a given amax
    b_ten = in_b + n // 2 + n // 16 + 8
    g = knv.tensor_amax(x)
    for cfg in nv["amax"]:
        add("nvfp4 amax pass alone", f"ours (reads x once) {_label(cfg)}", lambda t, c=cfg: knv.tensor_amax(t, **c),
            in_b + 4, "ours")
    # incl. amax: the default quantize kernel after each amax config (the quantize configs differ in the "amax
    # given" rows; the two kernels run one after the other, so their times add)
    for cfg in nv["amax"]:
        add("nvfp4 per-tensor incl. amax", f"ours (amax kernel + quantize kernel) amax {_label(cfg)}",
            lambda t, c=cfg: knv.per_tensor(t, knv.tensor_amax(t, **c, pdl=False)), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours default (amax kernel + quantize kernel, programmatic dependent launch)",
        lambda t: knv.per_tensor(t), b_ten, "ours")
    # PDL with other amax launch shapes: fewer resident amax programs leave SM room for the quantize kernel's
    # programs, which PDL starts while the amax kernel drains
    for cfg in nv["amax"]:
        if cfg and cfg.get("flat_block") != 0:  # the flat kernel at a shape other than the default
            add("nvfp4 per-tensor incl. amax", f"ours (PDL) amax {_label(cfg)}",
                lambda t, c=cfg: _with_amax_shape(c, lambda: knv.per_tensor(t)), b_ten, "ours")
    # the default's quantize pass walks the tensor backwards (TENSOR_REVERSE); this row is the A/B against it
    add("nvfp4 per-tensor incl. amax", "ours (PDL) quantize pass walks the tensor forwards",
        lambda t: knv.per_tensor(t, reverse=False), b_ten, "ours")
    # L2 hints (per_tensor l2_keep, off by default until these rows are measured): the amax pass keeps the last
    # l2_keep of L2 worth of x with evict_last, the reversed quantize pass reads it first and loads / stores
    # evict_first; the forwards row is the control (what it reads first was evicted first)
    for keep in L2_KEEP_ROWS:
        add("nvfp4 per-tensor incl. amax", f"ours (PDL) L2 hints, keep {keep:g} of L2",
            lambda t, f=keep: knv.per_tensor(t, l2_keep=f), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours (PDL) L2 hints, keep 0.5 of L2, quantize pass forwards",
        lambda t: knv.per_tensor(t, l2_keep=0.5, reverse=False), b_ten, "ours")
    # per-program partial maxima reduced by the quantize kernel (per_tensor amax_parts, off by default until these
    # rows are measured): no zero-fill launch, no atomics; 16384x7168 has too many programs and takes the atomics
    add("nvfp4 per-tensor incl. amax", "ours (PDL) amax partials, no zero-fill",
        lambda t: knv.per_tensor(t, amax_parts=True), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours (PDL) amax partials + L2 hints, keep 0.5 of L2",
        lambda t: knv.per_tensor(t, amax_parts=True, l2_keep=0.5), b_ten, "ours")
    # block amaxes on the packed halves, x unpacked after the PDL wait (per_tensor packed): 60 registers instead of 96
    # offline, but level or slower on the H100 (session 28), so off by default; these rows are its H200 A/B
    add("nvfp4 per-tensor incl. amax", "ours (PDL) packed block max",
        lambda t: knv.per_tensor(t, packed=True), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours (PDL) packed block max, 8-row tiles",
        lambda t: knv.per_tensor(t, packed=True, block_m=8), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours (PDL) packed block max + amax partials",
        lambda t: knv.per_tensor(t, packed=True, amax_parts=True), b_ten, "ours")
    # the default until session 28: zero-filled atomic amax, no L2 hints (the A/B of TENSOR_AMAX_PARTS / TENSOR_L2_KEEP)
    add("nvfp4 per-tensor incl. amax", "ours (PDL) atomic amax, no L2 hints (the default before session 28)",
        lambda t: knv.per_tensor(t, amax_parts=False, l2_keep=0), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours (amax kernel + quantize kernel, no PDL)",
        lambda t: knv.per_tensor(t, pdl=False), b_ten, "ours")
    add("nvfp4 per-tensor incl. amax", "ours (one launch: amax + quantize, one HBM read when it fits in L2)",
        lambda t: knv.per_tensor(t, one_pass=True), b_ten, "ours")
    if not only_nvfp4:
        add("nvfp4 per-tensor incl. amax", "our eager reference", lambda t: nvfp4.quantize(t, scope="tensor"),
            b_ten, "ref")
    for cfg in nv["tensor"]:
        add("nvfp4 per-tensor, amax given", f"ours (one pass) {_label(cfg)}",
            lambda t, c=cfg: knv.per_tensor(t, g, **c), b_ten, "ours")
    b_2d = in_b + n // 2 + n // 256 + 8
    add("nvfp4 16x16 weight tiles incl. amax", "ours default", lambda t: knv.per_tensor(t, tile_2d=True), b_2d,
        "ours")
    for cfg in nv["2d"]:
        add("nvfp4 16x16 weight tiles, amax given", f"ours {_label(cfg)}",
            lambda t, c=cfg: knv.per_tensor(t, g, tile_2d=True, **c), b_2d, "ours")
    if only_nvfp4:
        return rows
    add("nvfp4 16x16 weight tiles incl. amax", "our eager reference",
        lambda t: nvfp4.quantize(t, scope="tensor", tile_2d=True), b_2d, "ref")
    try:
        to_mx, SCM, nvfp4_quantize, per_tensor_amax_to_scale = _torchao()
        have_ao = True
    except Exception as e:
        have_ao = False
        log.append(f"torchao import failed: {type(e).__name__}: {e}")
    if have_ao:
        def ao_nvfp4_amax(t):
            return nvfp4_quantize(t, 16, per_tensor_amax_to_scale(torch.max(torch.abs(t))))

        def ao_nvfp4_given(t, s):
            return nvfp4_quantize(t, 16, s)

        ao_amax_c = torch.compile(ao_nvfp4_amax, dynamic=False)
        ao_given_c = torch.compile(ao_nvfp4_given, dynamic=False)
        pts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
        add("nvfp4 per-tensor incl. amax", "torchao nvfp4_quantize + amax, eager", lambda t: ao_nvfp4_amax(t), b_ten,
            "peer")
        add("nvfp4 per-tensor incl. amax", "torchao nvfp4_quantize + amax, torch.compile", lambda t: ao_amax_c(t),
            b_ten, "peer")
        add("nvfp4 per-tensor, amax given", "torchao nvfp4_quantize (scale given), torch.compile",
            lambda t: ao_given_c(t, pts), b_ten, "peer")

    # ---- MXFP8
    b_row = in_b + n + n // 32
    b_rc = in_b + 2 * n + 2 * (n // 32)
    cfg_m = {}
    if sweep:
        best = _best("mxfp8_rowcol", lambda c: (lambda t: kmx.quantize_rowcol(t, "e4m3", True, True, **c)),
                     SWEEP["mxfp8_rowcol"], log, xs)
        cfg_m = best[1] if best else {}
    add("mxfp8 e4m3 rowwise+columnwise", f"ours (one read, both copies) {cfg_m}",
        lambda t: kmx.quantize_rowcol(t, "e4m3", True, True, **cfg_m), b_rc, "ours")
    add("mxfp8 e4m3 rowwise+columnwise", "ours, default config (kernels.mxfp8_quantize_rowcol)",
        lambda t: kmx.quantize_rowcol(t, "e4m3", True, True), b_rc, "ours")
    add("mxfp8 e4m3 rowwise+columnwise", "our eager reference (row + col)",
        lambda t: (mxfp8.quantize(t, "e4m3", axis="row"), mxfp8.quantize(t, "e4m3", axis="col")), b_rc, "ref")
    add("mxfp8 e4m3 rowwise", f"ours {cfg_m}", lambda t: kmx.quantize_rowcol(t, "e4m3", True, False, **cfg_m), b_row,
        "ours")
    add("mxfp8 e4m3 columnwise", f"ours {cfg_m}", lambda t: kmx.quantize_rowcol(t, "e4m3", False, True, **cfg_m),
        b_row, "ours")
    # the weight update's rowwise kernel (quantize_rows_flat: the tensor as one run of 32-element blocks into
    # contiguous wire bytes, NaN/Inf counted) at its default and the launch shapes the update benchmark sweeps
    flat_d, flat_s = torch.empty((m, k), dtype=torch.uint8, device=x.device), \
        torch.empty((m, k // 32), dtype=torch.uint8, device=x.device)
    flat_bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    for ib, nw, scr in ((None, None, None), (None, None, False), (32, 2, None), (128, 4, None), (128, 8, None),
                        (256, 8, None)):
        add("mxfp8 e4m3 rowwise", "ours, flat (weight-update kernel)" + (f" {ib} blocks x {nw} warps" if ib else "")
            + (", NaN/Inf counted element by element" if scr is False else ""),
            lambda t, ib=ib, nw=nw, scr=scr: kmx.quantize_rows_flat(t, flat_d, flat_s, bad=flat_bad, item_blocks=ib,
                                                                   num_warps=nw, amax_screen=scr), b_row, "ours")
    add("mxfp8 e5m2 rowwise+columnwise", f"ours {cfg_m}", lambda t: kmx.quantize_rowcol(t, "e5m2", True, True,
                                                                                     **cfg_m), b_rc, "ours")
    if have_ao:
        def ao_row(t):
            return to_mx(t, torch.float8_e4m3fn, 32, SCM.RCEIL)

        def ao_col(t):
            return to_mx(t.t().contiguous(), torch.float8_e4m3fn, 32, SCM.RCEIL)

        ao_row_c = torch.compile(ao_row, dynamic=False)
        ao_col_c = torch.compile(ao_col, dynamic=False)
        add("mxfp8 e4m3 rowwise", "torchao to_mx RCEIL, eager", lambda t: ao_row(t), b_row, "peer")
        add("mxfp8 e4m3 rowwise", "torchao to_mx RCEIL, torch.compile", lambda t: ao_row_c(t), b_row, "peer")
        add("mxfp8 e4m3 columnwise", "torchao to_mx RCEIL of x.t(), torch.compile", lambda t: ao_col_c(t), b_row,
            "peer")
        add("mxfp8 e4m3 rowwise+columnwise", "torchao to_mx RCEIL row + col (two passes), eager",
            lambda t: (ao_row(t), ao_col(t)), b_rc, "peer")
        add("mxfp8 e4m3 rowwise+columnwise", "torchao to_mx RCEIL row + col (two passes), torch.compile",
            lambda t: (ao_row_c(t), ao_col_c(t)), b_rc, "peer")

    # ---- FP8 block
    b_fb = in_b + n + 4 * math.ceil(k / 128) * m
    cfg_f = {}
    if sweep:
        best = _best("fp8_block_1x128", lambda c: (lambda t: kfb.quantize(t, "e4m3", False, True, False, **c)),
                     SWEEP["fp8_block_1x128"], log, xs)
        cfg_f = best[1] if best else {}
    add("fp8-block 1x128 pow2", f"ours {cfg_f}", lambda t: kfb.quantize(t, "e4m3", False, True, False, **cfg_f), b_fb,
        "ours")
    add("fp8-block 1x128 pow2", "our eager reference", lambda t: fp8_block.quantize(t, "e4m3", (1, 128), True), b_fb,
        "ref")
    b_sq = in_b + n + 4 * math.ceil(k / 128) * math.ceil(m / 128)
    add("fp8-block 128x128 fp32 scale", "ours", lambda t: kfb.quantize(t, "e4m3", True, False, False), b_sq, "ours")
    add("fp8-block 128x128 fp32 scale", "our eager reference",
        lambda t: fp8_block.quantize(t, "e4m3", (128, 128), False), b_sq, "ref")
    add("fp8-block 1x128 pow2, x.T (colwise)", "ours (transposed store)",
        lambda t: kfb.quantize(t, "e4m3", False, True, True), b_fb, "ours")
    return rows


def render(shape, rows):
    copy = next(r for r in rows if r[4] == "copy")
    copy_gbs = copy[3] / copy[2] / 1e3
    lines = [f"### {shape[0]}x{shape[1]} bf16 (copy: {copy[2]:.1f} us, {copy_gbs:.0f} GB/s)", "",
             "| op | implementation | us | GB/s | % of copy | fastest peer / this |", "|---|---|---:|---:|---:|---:|"]
    groups = []
    for r in rows:
        if r[0] not in groups:
            groups.append(r[0])
    for grp in groups:
        rs = [r for r in rows if r[0] == grp]
        peers = [r[2] for r in rs if r[4] == "peer" and r[2] is not None]
        fastest = min(peers) if peers else None
        for g_, label, t, nb, kind in rs:
            if t is None:
                lines.append(f"| {g_} | {label} | failed | | | |")
                continue
            gbs = nb / t / 1e3
            ratio = f"{fastest / t:.2f}x" if fastest else "-"
            lines.append(f"| {g_} | {label} | {t:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {ratio} |")
    return "\n".join(lines)


def probe(m, k):
    """Each kernel (default config) 3 times on one bf16 input, for a profiler such as
    `ncu --clock-control none --section SpeedOfLight --section Occupancy -k regex:_nvfp4|_mxfp8|_fp8|_amax`."""
    import torch

    from precision_dsl.kernels import triton_fp8_block as kfb
    from precision_dsl.kernels import triton_mxfp8 as kmx
    from precision_dsl.kernels import triton_nvfp4 as knv

    x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
    for _ in range(3):
        knv.row_scaled(x)
        knv.per_tensor(x)
        kmx.quantize_rowcol(x, "e4m3", True, True)
        kfb.quantize(x, "e4m3", False, True, False)
    torch.cuda.synchronize()
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16384x7168,8192x2048,4096x4096")
    ap.add_argument("--no-sweep", action="store_true",
                    help="no best-of sweep for MXFP8 / FP8 block (NVFP4 rows: every config of --nvfp4-sweep anyway)")
    ap.add_argument("--nvfp4-sweep", default=None, metavar="SPEC",
                    help="NVFP4 launch configs, one row each: 'row:chunk=64,num_warps=2;tensor:block_m=8,block_nb=64,"
                         "num_warps=4;2d:block_nb=32,num_warps=4' (default: the tables in kernels/triton_nvfp4.py)")
    ap.add_argument("--only-nvfp4", action="store_true", help="copy + our NVFP4 rows only (no peers, no MXFP8/FP8)")
    ap.add_argument("--json", default=None, help="write raw rows (and the sweep log) to this file")
    ap.add_argument("--log", default=None, help="write the sweep / failure log to this file")
    ap.add_argument("--probe", action="store_true",
                    help="launch each of our kernels a few times at the first shape and exit (for `ncu`)")
    args = ap.parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("benchmarks/quantize.py needs a CUDA GPU (run it on the H200 through the device tool)")
        return 2
    props = torch.cuda.get_device_properties(0)
    try:
        import torchao

        ao_v = torchao.__version__
    except Exception as e:
        ao_v = f"not importable ({type(e).__name__})"
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), torch "
          f"{torch.__version__}, triton {triton.__version__}, torchao {ao_v}")
    if args.probe:
        return probe(*(int(v) for v in args.shapes.split(",")[0].lower().split("x")))
    log, out = [], {}
    for s in args.shapes.split(","):
        m, k = (int(v) for v in s.lower().split("x"))
        t0 = time.time()
        rows = run_shape(m, k, not args.no_sweep, log, nvfp4_configs(args.nvfp4_sweep), args.only_nvfp4)
        out[s] = rows
        print(render((m, k), rows))
        print(f"({time.time() - t0:.0f} s for this shape)\n", flush=True)
    if args.log:
        with open(args.log, "w") as f:
            f.write("\n".join(log))
    else:
        print("\n".join(log))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": out, "log": log}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
