"""Fused MXFP8 quantize kernel (Triton, Hopper sm_90), byte-identical to precision_dsl.formats.mxfp8 (TE rule).

`_mxfp8_rowcol_kernel` reads each [32*G, 32*NKB] input tile ONCE (as a 4-D [G, 32, NKB, 32] block, so both
reductions are plain axis reductions of the same registers, no reshape) and writes
  * the rowwise copy (1x32 blocks along K): data [M, K] fp8 bytes, scale [M, K/32] E8M0 bytes, and/or
  * the columnwise copy (32x1 blocks along M, data NOT transposed, TE's layout): data [M, K], scale [M/32, K].
E4M3 or E5M2 elements. Per block (see the reference docstring):
    a = NaN-ignoring max|x|;  d = RN(a * RN(1/Fmax));  E = e8m0_round_up_satfinite(d);  s = 2^(127-E)
    q = cvt.rn.satfinite(RN(x * s))   (x * s is exact; NaN -> 0x7F)
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from ..precision import FP8_MAX as FMAX
from ._common import e8m0_from_amax, max_nan

# RN(1/Fmax) as exact fp32 values (numpy fp32 division is IEEE RN); 1/448 -> 0x3B124925.
FMAX_RCP = {k: float(np.float32(1.0) / np.float32(v)) for k, v in FMAX.items()}


@triton.jit
def _to_fp8_bytes(v, E5M2: tl.constexpr):
    if E5M2:
        q = v.to(tl.float8e5)
    else:
        q = v.to(tl.float8e4nv)
    return q.to(tl.uint8, bitcast=True)


@triton.jit
def _count_non_finite(ax, bad_ptr):
    # |x| > FLT_MAX is inf; NaN fails every comparison, so `not (|x| <= FLT_MAX)` catches both (masked lanes are 0)
    nf = tl.sum((~(ax <= 3.4028234663852886e38)).to(tl.int32))
    if nf > 0:
        tl.atomic_add(bad_ptr, nf, sem="relaxed")


@triton.jit
def _mxfp8_rowcol_kernel(x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, M, K, stride_x,
                         stride_rd, stride_rs, stride_cd, stride_cs, FMAX_RCP: tl.constexpr, E5M2: tl.constexpr,
                         DO_ROW: tl.constexpr, DO_COL: tl.constexpr, G: tl.constexpr, NKB: tl.constexpr):
    """One [32*G rows, 32*NKB cols] tile per program, held as a 4-D [NKB, G, 32 rows, 32 cols] block.

    The dim order matters: Triton's coalescing pass orders the non-contiguous dims by index, so putting the
    column-block dim first makes threads spread over column blocks before rows. A thread then holds several rows
    of the same 16 columns: the 32x1 (column) reduction is mostly inside the thread and the column E8M0 is
    computed by few threads (putting rows first gave ~47 SASS instructions per element, mostly replicated E8M0)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    stride_x = tl.multiple_of(stride_x, 32)  # = K, a multiple of 32 (checked by the host wrapper)
    stride_rd = tl.multiple_of(stride_rd, 32)
    stride_cd = tl.multiple_of(stride_cd, 32)
    kb = tl.arange(0, NKB)
    g = tl.arange(0, G)
    r = tl.arange(0, 32)
    c = tl.arange(0, 32)
    rows = pid_m * (G * 32) + g[None, :, None, None] * 32 + r[None, None, :, None]  # [1, G, 32, 1]
    kblk = pid_k * NKB + kb  # [NKB] 32-column block index
    cols = kblk[:, None, None, None] * 32 + c[None, None, None, :]  # [NKB, 1, 1, 32]
    mask = (rows < M) & (cols < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    if DO_ROW:
        amax_r = tl.maximum(tl.max(ax, axis=3), 0.0)  # [NKB, G, 32]
        e_r, s_r = e8m0_from_amax(amax_r, FMAX_RCP)
        q_r = _to_fp8_bytes(x * s_r[:, :, :, None], E5M2)
        tl.store(row_data_ptr + rows64 * stride_rd + cols, q_r, mask=mask)
        rows3 = pid_m * (G * 32) + g[None, :, None] * 32 + r[None, None, :]  # [1, G, 32]
        smask = (rows3 < M) & (kblk[:, None, None] * 32 < K)
        tl.store(row_scale_ptr + rows3.to(tl.int64) * stride_rs + kblk[:, None, None], e_r.to(tl.uint8),
                 mask=smask)
    if DO_COL:
        amax_c = tl.maximum(tl.max(ax, axis=2), 0.0)  # [NKB, G, 32]
        e_c, s_c = e8m0_from_amax(amax_c, FMAX_RCP)
        q_c = _to_fp8_bytes(x * s_c[:, :, None, :], E5M2)
        tl.store(col_data_ptr + rows64 * stride_cd + cols, q_c, mask=mask)
        srow = pid_m * G + g[None, :, None]  # [1, G, 1] 32-row block index
        cols3 = kblk[:, None, None] * 32 + c[None, None, :]  # [NKB, 1, 32]
        smask = (srow * 32 < M) & (cols3 < K)
        tl.store(col_scale_ptr + srow.to(tl.int64) * stride_cs + cols3, e_c.to(tl.uint8), mask=smask)


@triton.jit
def _mxfp8_rowcol_split_kernel(x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr, bad_ptr, M, K,
                               stride_x, stride_rd, stride_rs, stride_cd, stride_cs, FMAX_RCP: tl.constexpr,
                               E5M2: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr, RO: tl.constexpr,
                               NKB: tl.constexpr, COUNT_BAD: tl.constexpr):
    """Same result as _mxfp8_rowcol_kernel for one 32-row stripe x 32*NKB columns per program, with the 32 rows
    split as RO x (32/RO) and held as a 4-D [RO, NKB, 32/RO, 32] block. Threads spread over RO first, so the 32x1
    column reduction is (32/RO) in-thread steps plus log2(RO) warp shuffles - no shared memory, no barrier - and
    the warps spread over column blocks only (needs NKB >= 2 * num_warps).
    COUNT_BAD: add the tile's NaN/Inf count to *bad_ptr (the weight update refuses non-finite weights; counting in
    the pass that reads x anyway saves the update a separate read of every byte)."""
    RI: tl.constexpr = 32 // RO
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    stride_x = tl.multiple_of(stride_x, 32)
    stride_rd = tl.multiple_of(stride_rd, 32)
    stride_cd = tl.multiple_of(stride_cd, 32)
    ro = tl.arange(0, RO)
    kb = tl.arange(0, NKB)
    ri = tl.arange(0, RI)
    c = tl.arange(0, 32)
    rows = pid_m * 32 + ro[:, None, None, None] * RI + ri[None, None, :, None]  # [RO, 1, RI, 1]
    kblk = pid_k * NKB + kb
    cols = kblk[None, :, None, None] * 32 + c[None, None, None, :]  # [1, NKB, 1, 32]
    mask = (rows < M) & (cols < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    if COUNT_BAD:
        _count_non_finite(ax, bad_ptr)
    if DO_ROW:
        amax_r = tl.maximum(tl.max(ax, axis=3), 0.0)  # [RO, NKB, RI]
        e_r, s_r = e8m0_from_amax(amax_r, FMAX_RCP)
        q_r = _to_fp8_bytes(x * s_r[:, :, :, None], E5M2)
        tl.store(row_data_ptr + rows64 * stride_rd + cols, q_r, mask=mask)
        rows3 = pid_m * 32 + ro[:, None, None] * RI + ri[None, None, :]  # [RO, 1, RI]
        smask = (rows3 < M) & (kblk[None, :, None] * 32 < K)
        tl.store(row_scale_ptr + rows3.to(tl.int64) * stride_rs + kblk[None, :, None], e_r.to(tl.uint8),
                 mask=smask)
    if DO_COL:
        amax_c = tl.maximum(tl.max(tl.max(ax, axis=2), axis=0), 0.0)  # [NKB, 32]
        e_c, s_c = e8m0_from_amax(amax_c, FMAX_RCP)
        q_c = _to_fp8_bytes(x * s_c[None, :, None, :], E5M2)
        tl.store(col_data_ptr + rows64 * stride_cd + cols, q_c, mask=mask)
        cols2 = kblk[:, None] * 32 + c[None, :]  # [NKB, 32]
        tl.store(col_scale_ptr + pid_m.to(tl.int64) * stride_cs + cols2, e_c.to(tl.uint8),
                 mask=(cols2 < K) & (pid_m * 32 < M))


def quantize_rowcol(x2, element="e4m3", rowwise=True, colwise=True, *, split_ro=8, group=1, nkb=8, num_warps=4,
                    out_row=None, bad=None):
    """MXFP8 of a contiguous [M, K] bf16/fp16/fp32 CUDA tensor, both copies from one read of x.

    Needs K % 32 == 0 (rowwise) and M % 32 == 0 (colwise). Returns (row_data, row_scale, col_data, col_scale),
    None for a copy not asked for. Data are uint8 fp8 bytes [M, K]; scales uint8 E8M0 [M, K/32] / [M/32, K].
    split_ro: use _mxfp8_rowcol_split_kernel with the 32 rows split RO x 32/RO (default, tuned on the H200);
    None: _mxfp8_rowcol_kernel with `group` 32-row stripes per program. out_row: (data, scale) row-major 2-D uint8
    tensors of those shapes to write the rowwise copy into (e.g. slices of a weight-update wire buffer). bad: an int32
    CUDA tensor of one element that the NaN/Inf count of x is added to (split kernel only)."""
    import torch

    m, k = x2.shape
    dev = x2.device
    if out_row is not None:
        rd, rs = out_row
    else:
        rd = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
        rs = torch.empty((m, k // 32), dtype=torch.uint8, device=dev) if rowwise else None
    cd = torch.empty((m, k), dtype=torch.uint8, device=dev) if colwise else None
    cs = torch.empty((m // 32, k), dtype=torch.uint8, device=dev) if colwise else None
    if m and k:
        from ._common import LAUNCH_OPTS

        dummy = rd if rd is not None else cd
        rd_, rs_ = (rd, rs) if rowwise else (dummy, dummy)
        cd_, cs_ = (cd, cs) if colwise else (dummy, dummy)
        args = (x2, rd_, rs_, cd_, cs_, m, k, x2.stride(0), rd_.stride(0), rs_.stride(0), cd_.stride(0),
                cs_.stride(0))
        common = dict(FMAX_RCP=FMAX_RCP[element], E5M2=element == "e5m2", DO_ROW=rowwise, DO_COL=colwise, NKB=nkb,
                      num_warps=num_warps, **LAUNCH_OPTS)
        if split_ro:
            grid = (triton.cdiv(m, 32), triton.cdiv(k // 32, nkb))
            _mxfp8_rowcol_split_kernel[grid](*args[:5], bad if bad is not None else dummy, *args[5:], RO=split_ro,
                                             COUNT_BAD=bad is not None, **common)
        else:
            if bad is not None:
                raise ValueError("bad= (NaN/Inf count) needs the split kernel (split_ro)")
            grid = (triton.cdiv(m, 32 * group), triton.cdiv(k // 32, nkb))
            _mxfp8_rowcol_kernel[grid](*args, G=group, **common)
    return rd, rs, cd, cs


@triton.jit
def _mxfp8_row_item(x_ptr, data_ptr, scale_ptr, bad_ptr, j, N_BLOCKS, FMAX_RCP: tl.constexpr, E5M2: tl.constexpr,
                    IB: tl.constexpr, EVEN: tl.constexpr, COUNT_BAD: tl.constexpr, AMAX_SCREEN: tl.constexpr):
    """Rowwise (1x32) MXFP8 of item j (IB 32-element blocks) of a contiguous [M, K] tensor seen as a flat run of
    32-element blocks: the rowwise arithmetic of _mxfp8_rowcol_split_kernel without its 2-D tile (no padded lanes
    for any K, no column tile bookkeeping). Data and scales are contiguous, so block b's bytes are
    data[32b:32b+32] and its E8M0 is scale[b]. EVEN: N_BLOCKS % IB == 0 (no masks).

    COUNT_BAD: the item's NaN/Inf count is added to bad_ptr. AMAX_SCREEN (with COUNT_BAD): nothing is done per
    element for it beyond the block max the scale needs, taken NaN-PROPAGATING (max.NaN.f32, the same one
    instruction as max.f32): the item's max is NaN or inf exactly when an element is non-finite, and only then
    (rare: the update is refused) are the elements counted and the NaN-ignoring block max taken. For finite
    inputs the two maxes are the same value (max is exact), so the bytes are those of the NaN-ignoring max for
    every input. Offline sm_90 SASS per element at 64 blocks x 4 warps (`benchmarks/sass_count.py --kernels
    mxfp8flat`): 13.6 with the per-element count (a compare, a select and an add each, then a cross-warp sum),
    ~10.7 on this screen's hot path (16.3 counting the rare branch's code), 8.3 with no count at all."""
    blk = j.to(tl.int64) * IB + tl.arange(0, IB)
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    if EVEN:
        x = tl.load(x_ptr + offs).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=(blk < N_BLOCKS)[:, None], other=0.0).to(tl.float32)
    ax = tl.abs(x)
    if COUNT_BAD and AMAX_SCREEN:
        amax = tl.reduce(ax, 1, max_nan)  # [IB]
        if not (tl.reduce(amax, 0, max_nan) < float("inf")):  # a NaN or +-inf in the item
            _count_non_finite(ax, bad_ptr)
            amax = tl.max(ax, axis=1)
    else:
        if COUNT_BAD:
            _count_non_finite(ax, bad_ptr)
        amax = tl.max(ax, axis=1)  # [IB]
    amax = tl.maximum(amax, 0.0)
    e, s = e8m0_from_amax(amax, FMAX_RCP)
    q = _to_fp8_bytes(x * s[:, None], E5M2)
    if EVEN:
        tl.store(data_ptr + offs, q)
        tl.store(scale_ptr + blk, e.to(tl.uint8))
    else:
        tl.store(data_ptr + offs, q, mask=(blk < N_BLOCKS)[:, None])
        tl.store(scale_ptr + blk, e.to(tl.uint8), mask=blk < N_BLOCKS)


@triton.jit
def _mxfp8_row_items_kernel(x_ptr, data_ptr, scale_ptr, bad_ptr, N_BLOCKS, FMAX_RCP: tl.constexpr,
                            E5M2: tl.constexpr, IB: tl.constexpr, EVEN: tl.constexpr, COUNT_BAD: tl.constexpr,
                            AMAX_SCREEN: tl.constexpr):
    """_mxfp8_row_item of item program_id(0)."""
    _mxfp8_row_item(x_ptr, data_ptr, scale_ptr, bad_ptr, tl.program_id(0), N_BLOCKS, FMAX_RCP, E5M2, IB, EVEN,
                    COUNT_BAD, AMAX_SCREEN)


ROW_ITEM_BLOCKS = 64  # 32-element blocks per program of quantize_rows_flat (2048 elements)
ROW_NUM_WARPS = 4
# True (default): the NaN/Inf count rides the block max (see _mxfp8_row_item); False: counted element by element.
# H200, session 26 (benchmarks/RESULTS.md): the 1.34B model's MXFP8 update, interleaved with BF16, three A/Bs:
# 0.788 / 0.794 / 0.797x BF16 against 0.805 / 0.805 / 0.809x counted (level at 30.5B); quantize.py's flat rowwise
# kernel 14.2-14.3 vs 14.7 us at 8192x2048, level at 16384x7168. A/B: weight_update_gpu.py mode suffixes ~count /
# ~screen, quantize.py's flat rows. Read at each launch.
ROW_AMAX_SCREEN = True


def quantize_rows_flat(x2, data, scale, element="e4m3", *, bad=None, item_blocks=None, num_warps=None,
                       amax_screen=None):
    """Rowwise MXFP8 of a contiguous [M, K] bf16/fp16/fp32 CUDA tensor (K % 32 == 0) into contiguous data uint8
    [M, K] and scale uint8 [M, K/32] (e.g. a weight-update wire buffer), the NaN/Inf count of x added to bad (int32
    [1]) when given. Same bytes as quantize_rowcol(rowwise only). item_blocks / num_warps / amax_screen: launch
    shape and how the count is taken only (defaults ROW_ITEM_BLOCKS / ROW_NUM_WARPS / ROW_AMAX_SCREEN, read at
    the call); the bytes and the count do not depend on them."""
    from ._common import LAUNCH_OPTS

    item_blocks = item_blocks or ROW_ITEM_BLOCKS
    num_warps = num_warps or ROW_NUM_WARPS
    amax_screen = ROW_AMAX_SCREEN if amax_screen is None else bool(amax_screen)

    m, k = x2.shape
    if k % 32 or not (x2.is_contiguous() and data.is_contiguous() and scale.is_contiguous()):
        raise ValueError("quantize_rows_flat needs K % 32 == 0 and contiguous input and outputs")
    n_blocks = m * k // 32
    if n_blocks == 0:
        return
    _mxfp8_row_items_kernel[(triton.cdiv(n_blocks, item_blocks),)](
        x2, data, scale, bad if bad is not None else scale, n_blocks, FMAX_RCP=FMAX_RCP[element],
        E5M2=element == "e5m2", IB=item_blocks, EVEN=n_blocks % item_blocks == 0, COUNT_BAD=bad is not None,
        AMAX_SCREEN=amax_screen, num_warps=num_warps, **LAUNCH_OPTS)
