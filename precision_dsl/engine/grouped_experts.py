"""All routed experts of one MoE layer as ONE grouped op (GPU): one dispatch, one quantization per operand, one
elementwise pass, one combine, and per expert only its GEMMs.

The per-expert loop (model.SparseMoeBlock) gathers each expert's tokens, runs its three linears through the executor
(each quantizing its own input: a kernel launch plus Python per expert and per operand, in the forward and again in
the backward) and adds its output back. On the H200 that host work, not the GPU, set the pace of native FP8 at
hidden 4096 (profiled: fp8-blockwise-hopper spent LESS kernel time than BF16 in the rollout and the train phase,
and more wall time; benchmarks/RESULTS.md, "routed experts as one grouped op"). Megatron runs the same experts as a
grouped GEMM with one input quantization for all experts (TE GroupedLinear); this module does the same with
per-expert GEMMs over one grouped buffer:

* dispatch: the (token, slot) pairs sorted by expert (stable), each expert's rows placed at a segment of a padded
  buffer whose segments start at multiples of `align` rows; pad rows are zero. The positions are computed on the
  device; the host reads the per-expert counts once per layer (it needs them for the GEMM shapes) AFTER the gather
  and the input quantization are queued, so that wait overlaps GPU work instead of draining the queue.
* quantization: 1x128 FP8 rows are per token, so ONE quantization of the grouped buffer gives every expert exactly
  the bytes of its own rows; with `align` = 128 each 128-token column block lies inside one expert's segment (zero
  rows pad it), so the columnwise copy of the grouped buffer IS each expert's columnwise copy zero-padded to whole
  128-token blocks - the bytes the per-expert path quantizes (tests/test_engine_grouped_experts.py).
* GEMMs: per expert, over its whole segment, written in place into grouped outputs. Zero rows give zero outputs;
  they are up to align - 1 rows more than the expert's tokens (with 128: ~2% more GEMM rows at ~3k tokens per expert),
  which keeps every grouped buffer's pad rows zero for the next columnwise quantization without a clearing pass.
* combine: each token's expert outputs summed in fp32 in ascending expert order, as the loop's sequence of
  index_add_ calls does (bitwise the same sum).

Kinds: "fp8" (fp8-blockwise-hopper's native FP8: 1x128 activations/gradients x 128x128 weights, quantized backward)
and "bf16" (unquantized linears). Any other mix of formats keeps the per-expert loop (the executor returns no
runner). Only on CUDA: the loop is the CPU path and the reference - except the independent rollout's "rows" kind
(CPU, activations that quantize each row on its own: one quantization per operand for all experts, the loop's GEMMs
over the same rows). This module holds the dispatch, the combine and the trainer's op; the independent rollout's
runner (no autograd) is rollout_gemm.RolloutExperts, over its `gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import fastgemm


MODES = ("auto", "on", "off")


def mode_from_env() -> str:
    """POLICYC_GROUPED_EXPERTS: auto (default: grouped on CUDA, the loop elsewhere), on (any device: tests), off (the
    per-expert loop everywhere: the A/B baseline)."""
    import os

    m = os.environ.get("POLICYC_GROUPED_EXPERTS", "auto")
    if m not in MODES:
        raise ValueError(f"POLICYC_GROUPED_EXPERTS must be one of {', '.join(MODES)}, got {m!r}")
    return m


def wanted(mode: str, x: torch.Tensor) -> bool:
    return mode == "on" or (mode == "auto" and x.is_cuda)


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass
class Dispatch:
    """Where each (token, slot) pair of one MoE layer sits in the grouped buffer."""

    order: torch.Tensor  # [P] pair indices sorted by expert (stable)
    pos: torch.Tensor  # [P] buffer row of sorted pair i
    rows: int  # buffer rows (a bound the host knows without reading the counts)
    align: int
    _counts: torch.Tensor  # [E] on the host (filled by a non-blocking copy)
    _ready: Optional[object]  # CUDA event after that copy
    _segments: Optional[list] = None

    def segments(self) -> list[tuple[int, int, int]]:
        """(start row, tokens, segment rows) per expert; waits for the counts (the layer's one host sync)."""
        if self._segments is None:
            if self._ready is not None:
                self._ready.synchronize()
            start, segs = 0, []
            for n in self._counts.tolist():
                r = _up(n, self.align)
                segs.append((start, n, r))
                start += r
            self._segments = segs
        return self._segments

    @property
    def used_rows(self) -> int:
        s, _, r = self.segments()[-1]
        return s + r


def dispatch(topi: torch.Tensor, num_experts: int, align: int) -> Dispatch:
    """topi [T, k] expert indices -> Dispatch (device work only; the counts travel to the host asynchronously)."""
    pairs = topi.reshape(-1)
    p = pairs.numel()
    order = pairs.argsort(stable=True)
    # not torch.bincount: on CUDA it reads the maximum back to size its output (a host sync, two on the H200)
    counts = torch.zeros(num_experts, dtype=torch.long, device=pairs.device).scatter_add_(0, pairs,
                                                                                         torch.ones_like(pairs))
    ready = None
    if counts.is_cuda:
        host = torch.empty(num_experts, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host = counts
    seg = (counts + (align - 1)) // align * align
    starts = seg.cumsum(0) - seg
    first = counts.cumsum(0) - counts  # each expert's first index in the sorted pairs
    expert = pairs[order]
    pos = starts[expert] + torch.arange(p, device=pairs.device) - first[expert]
    rows = p if align == 1 else _up(p + num_experts * (align - 1), max(align, 16))
    return Dispatch(order, pos, rows, align, host, ready)


def gather(flat: torch.Tensor, top_k: int, d: Dispatch) -> torch.Tensor:
    """[T, H] tokens -> the grouped buffer [rows, H] (zero rows outside the experts' tokens)."""
    src = flat[d.order // top_k]
    return flat.new_zeros(d.rows, flat.shape[1]).index_copy(0, d.pos, src)


def combine(y: torch.Tensor, topw: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """Grouped expert outputs -> [T, H] fp32: sum over each token's experts of y * weight, in ascending expert order
    (the loop's index_add_ sequence: out = ((0 + y_e1 w_1) + y_e2 w_2) + ..., e1 < e2 < ...)."""
    t, k = topw.shape
    inv = torch.empty_like(d.order)
    inv[d.order] = torch.arange(d.order.numel(), device=d.order.device)
    srt = inv.view(t, k).sort(-1).values  # each token's sorted-pair indices, ascending = ascending expert
    w = topw.reshape(-1)[d.order][srt]
    ys = y[d.pos[srt].reshape(-1)].view(t, k, y.shape[1])  # one gather (one gradient buffer in the backward)
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(k):
        out = out + (ys[:, j] * w[:, j, None]).float()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the trainer's grouped experts (autograd)
# ---------------------------------------------------------------------------------------------------------------
class TrainerExperts:
    """The routed experts of one layer on the trainer's fast path, as one autograd op. `fws` / `specs` / `params`:
    per expert (gate, up, down) FastWeights, LinearSpecs and master parameters."""

    def __init__(self, ex, kind: str, fws: list, specs: list, params: list):
        self.ex, self.kind, self.fws, self.specs, self.params = ex, kind, fws, specs, params
        self.wants_backward = False  # set per call: whether autograd will run this op's backward

    @property
    def align(self) -> int:
        if self.kind == "bf16":
            return 1
        return 128 if torch.is_grad_enabled() else 16  # 128: whole columnwise blocks per expert for wgrad

    def __call__(self, x_pad: torch.Tensor, d: Dispatch) -> torch.Tensor:
        flat_params = [p for trio in self.params for p in trio]
        self.wants_backward = torch.is_grad_enabled() and (x_pad.requires_grad
                                                           or any(p.requires_grad for p in flat_params))
        return GroupedExpertsFunction.apply(x_pad, self, d, *flat_params)


def _fp8_into(ex, out, a_data, a_scale, w_q, stats, ea, ew):
    """out = A (1x128) @ W (128x128 tiles)^T natively; where cuBLASLt refuses the shape, emulated as the fp32 GEMM
    of the dequantized operands (the loop's fallback is the same contract, its GEMM split differently)."""
    y = ex.fp8(a_data, a_scale, (1, 128), w_q.data, w_q.scale, (128, 128), ea, ew, stats, out=out)
    if y is None:
        out.copy_(fastgemm._ref_blocked(a_data, a_scale, (1, 128), w_q.data, w_q.scale, (128, 128), ea, ew))
        stats.add(fastgemm.FP8_FALLBACK)
    return out


def _fp8_wgrad(ex, g_col, x_col, s: int, r: int, stats, eg, ea):
    """dW [N, K] = G^col[:, seg] @ X^col[:, seg]^T, 1x128 blocks along the segment's tokens (column slices of the
    grouped columnwise copies, read in place)."""
    b0, b1 = s // 128, (s + r) // 128
    a_d, a_s = g_col.data[:, s:s + r], g_col.scale[:, b0:b1]
    b_d, b_s = x_col.data[:, s:s + r], x_col.scale[:, b0:b1]
    y = ex.fp8(a_d, a_s, (1, 128), b_d, b_s, (1, 128), eg, ea, stats)
    if y is None:
        y = fastgemm._ref_blocked(a_d, a_s, (1, 128), b_d, b_s, (1, 128), eg, ea)
        stats.add(fastgemm.FP8_FALLBACK)
    return y


def _rows(x16: torch.Tensor, fmt, cols: bool):
    """x16's rowwise 1x128 operand (data, scale in cuBLASLt's layout) and, with cols, its columnwise copy."""
    if cols:
        _, data, scale, q_col = fastgemm.fp8_rowcol16(x16, fmt)
        return data, scale, q_col
    _, data, scale = fastgemm.fp8_rows16(x16, fmt)
    return data, scale, None


def seg_scale(scale: torch.Tensor, s: int, r: int) -> torch.Tensor:
    """A segment's 1x128 scales in cuBLASLt's outer-dim-major layout (one small copy, shared by the GEMMs that read
    the segment)."""
    return fastgemm.outer_major_m4(scale[s:s + r])


class GroupedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_pad, run: TrainerExperts, d: Dispatch, *params):
        ex, stats = run.ex, run.ex.stats
        x16 = x_pad.to(torch.bfloat16)
        fp8 = run.kind == "fp8"
        if fp8:
            act = run.specs[0][0].activation
            xd, xs, x_col = _rows(x16, act, run.wants_backward)
        segs = d.segments()
        used = d.used_rows
        inter = run.fws[0][0].w16.shape[0]
        hidden = x_pad.shape[1]
        g = x_pad.new_empty(used, inter, dtype=torch.float32)
        u = torch.empty_like(g)
        for e, (s, n, r) in enumerate(segs):
            if not n:
                continue
            fg, fu, _ = run.fws[e]
            stats.flops += 2 * n * hidden * inter * (9 if run.wants_backward else 3)
            if fp8:
                sg, su = run.specs[e][0], run.specs[e][1]
                sa = seg_scale(xs, s, r)
                _fp8_into(ex, g[s:s + r], xd[s:s + r], sa, fg.q, stats, sg.activation.element, sg.weight.element)
                _fp8_into(ex, u[s:s + r], xd[s:s + r], sa, fu.q, stats, su.activation.element, su.weight.element)
            else:
                fastgemm.mm_bf16_into(g[s:s + r], x16[s:s + r], fg.w16, stats)
                fastgemm.mm_bf16_into(u[s:s + r], x16[s:s + r], fu.w16, stats)
        h16 = (F.silu(g) * u).to(torch.bfloat16)  # the down_proj's BF16 input (zero on pad rows: silu(0) * 0)
        y = x_pad.new_empty(used, hidden, dtype=torch.float32)  # combine reads rows < used only
        if fp8:
            hd, hs, h_col = _rows(h16, run.specs[0][2].activation, run.wants_backward)
        for e, (s, n, r) in enumerate(segs):
            if not n:
                continue
            fd = run.fws[e][2]
            if fp8:
                sd = run.specs[e][2]
                _fp8_into(ex, y[s:s + r], hd[s:s + r], seg_scale(hs, s, r), fd.q, stats, sd.activation.element,
                          sd.weight.element)
            else:
                fastgemm.mm_bf16_into(y[s:s + r], h16[s:s + r], fd.w16, stats)
        ctx.run, ctx.d, ctx.rows = run, d, x_pad.shape[0]
        if run.wants_backward:
            ctx.saved = (x_col, h_col) if fp8 else (x16, h16)
            ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, gy):
        run, d = ctx.run, ctx.d
        ex, stats = run.ex, run.ex.stats
        g, u = ctx.saved_tensors
        a_saved, h_saved = ctx.saved
        ctx.saved = None
        segs = d.segments()
        used = d.used_rows
        fp8 = run.kind == "fp8"
        grads: list = [None] * (3 * len(segs))
        g16 = gy.to(torch.bfloat16)  # [used, H], as the forward's output
        dh = g.new_empty(g.shape)
        if fp8:
            gd, gs, g_col = _rows(g16, run.specs[0][2].grad, True)
        for e, (s, n, r) in enumerate(segs):
            if not n:
                continue
            fd, sd = run.fws[e][2], run.specs[e][2]
            if fp8:
                _fp8_into(ex, dh[s:s + r], gd[s:s + r], seg_scale(gs, s, r), fd.col_tiles(), stats,
                          sd.grad.element, sd.weight.element)
                grads[3 * e + 2] = _fp8_wgrad(ex, g_col, h_saved, s, r, stats, sd.grad.element,
                                              sd.activation.element)
            else:
                fastgemm.mm_bf16_into(dh[s:s + r], g16[s:s + r], fd.w16.t(), stats)
                grads[3 * e + 2] = fastgemm.mm(fastgemm.Op(g16[s:s + r].t()), fastgemm.Op(h_saved[s:s + r].t()),
                                               stats)
        # F.silu(g) * u, differentiated as autograd does: d(u) = dh * silu(g), d(silu) = dh * u -> silu_backward
        dg16 = torch.ops.aten.silu_backward(dh * u, g).to(torch.bfloat16)
        du16 = (dh * F.silu(g)).to(torch.bfloat16)
        hidden = gy.shape[1]
        dxg = gy.new_empty(used, hidden)
        dxu = torch.empty_like(dxg)
        if fp8:
            dgd, dgs, dg_col = _rows(dg16, run.specs[0][0].grad, True)
            dud, dus, du_col = _rows(du16, run.specs[0][1].grad, True)
        for e, (s, n, r) in enumerate(segs):
            if not n:
                continue
            (fg, fu, _), (sg, su, _) = run.fws[e], run.specs[e]
            if fp8:
                _fp8_into(ex, dxg[s:s + r], dgd[s:s + r], seg_scale(dgs, s, r), fg.col_tiles(), stats,
                          sg.grad.element, sg.weight.element)
                _fp8_into(ex, dxu[s:s + r], dud[s:s + r], seg_scale(dus, s, r), fu.col_tiles(), stats,
                          su.grad.element, su.weight.element)
                grads[3 * e] = _fp8_wgrad(ex, dg_col, a_saved, s, r, stats, sg.grad.element, sg.activation.element)
                grads[3 * e + 1] = _fp8_wgrad(ex, du_col, a_saved, s, r, stats, su.grad.element,
                                              su.activation.element)
            else:
                fastgemm.mm_bf16_into(dxg[s:s + r], dg16[s:s + r], fg.w16.t(), stats)
                fastgemm.mm_bf16_into(dxu[s:s + r], du16[s:s + r], fu.w16.t(), stats)
                xe = fastgemm.Op(a_saved[s:s + r].t())
                grads[3 * e] = fastgemm.mm(fastgemm.Op(dg16[s:s + r].t()), xe, stats)
                grads[3 * e + 1] = fastgemm.mm(fastgemm.Op(du16[s:s + r].t()), xe, stats)
        dx = gy.new_empty(ctx.rows, hidden)
        torch.add(dxg, dxu, out=dx[:used])  # the gate's and the up's dx, summed as autograd sums them
        dx[used:].zero_()  # rows past the segments hold no token
        return (dx, None, None, *grads)

