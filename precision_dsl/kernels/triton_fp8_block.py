"""Fused FP8 block-scaling quantize kernels (Triton, Hopper sm_90), byte-identical to
precision_dsl.formats.fp8_block (TE Float8BlockScaling / DeepSeek-V3 layout: fp32 scale_inv, compact grid).

`_fp8_block_kernel` quantizes one [BLOCK_R, BLOCK_C] tile of a matrix per program; with ROWS_PER_BLOCK = 1 the
blocks are 1x128 (rows independent), with 128 they are 128x128 tiles. TRANSPOSE_OUT writes the quantized tile
transposed (used for axis="col", i.e. the recipe applied to x.T, whose data TE stores transposed): then the blocks
run along the input's rows (128x1 / 128x128) and the tile is transposed in registers before the store.

Per block (see the reference docstring):
    a = NaN-ignoring max|x| (partial blocks: valid elements only)
    scale = 1 if a == 0 or a == inf, else RN(Fmax / a) (IEEE div_rn); inf -> max finite of the INPUT dtype
    pow2: scale = bits(scale) & 0xFF800000;  scale_inv = RN(1 / scale);  q = cvt.rn.satfinite(RN(x * scale))

Row padding (the trainer's wgrad contracts over the token dim, so it wants columnwise copies whose token dim is a
multiple of 128): the kernel takes two row bounds, R_LD for the loads (the real rows, other=0.0) and R >= R_LD for the
stores, so quantize(..., pad_rows_to=128) writes the quantization of [x; zeros] without materialising the zeros.
ROWCOL (TRANSPOSE_OUT with 1x128 blocks only): the same [128, BLOCK_C] tile is also quantized in 1x128 row blocks
and stored untransposed for the real rows (quantize_rowcol: both copies of the fp8 backward from one read of x).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..precision import FP8_MAX as FMAX
from .triton_mxfp8 import _count_non_finite


@triton.jit
def _scale_from_amax(a, FMAX: tl.constexpr, IN_MAX: tl.constexpr, POW2: tl.constexpr):
    scale = tl.math.div_rn(tl.full(a.shape, FMAX, tl.float32), a)
    scale = tl.where(scale == float("inf"), IN_MAX, scale)
    scale = tl.where((a == 0.0) | (a == float("inf")), 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    scale_inv = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), scale)
    return scale, scale_inv


@triton.jit
def _fp8_block_kernel(x_ptr, data_ptr, sinv_ptr, bad_ptr, row_data_ptr, row_sinv_ptr, R, R_LD, R_ROW, C, stride_x,
                      stride_d, stride_s, stride_sc, stride_rd, stride_rs, stride_rsc, FMAX: tl.constexpr, IN_MAX: tl.constexpr, E5M2: tl.constexpr,
                      POW2: tl.constexpr, SQUARE: tl.constexpr, TRANSPOSE_OUT: tl.constexpr, ROWCOL: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COUNT_BAD: tl.constexpr):
    """x: [R_LD, C], quantized as if zero-padded to [R, C] (R >= R_LD; R == R_LD: no padding). Not transposed:
    blocks of 1x128 (SQUARE=False) or 128x128 along C; data [R, C], scale_inv [R, ceil(C/128)] or
    [ceil(R/128), ceil(C/128)]. TRANSPOSE_OUT: blocks of 128x1 / 128x128 along R (BLOCK_R must be 128); data [C, R]
    (= quantization of x.T), scale_inv [C, ceil(R/128)] or [ceil(C/128), ceil(R/128)].
    ROWCOL (TRANSPOSE_OUT, not SQUARE): also the 1x128 row blocks of the tile, for rows < R_ROW (R_LD <= R_ROW <= R:
    the rows past R_LD are the quantization of zero rows, i.e. zero bytes with scale_inv 1): row data [R_ROW, C],
    row scale_inv [R_ROW, ceil(C/128)] (BLOCK_C is a multiple of 128, so a tile holds whole row blocks).
    stride_sc / stride_rsc: column strides of the 1x128 scale grids (non-transposed, and ROWCOL's row copy), so a
    grid can be written straight into the outer-dim-major layout cuBLASLt's block-scaled GEMM reads.
    COUNT_BAD: add the tile's NaN/Inf count to *bad_ptr (the weight update's refusal, in the same read of x)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    NCB: tl.constexpr = BLOCK_C // 128
    cb = tl.arange(0, NCB)
    ci = tl.arange(0, 128)
    cols = pid_c * BLOCK_C + cb[:, None] * 128 + ci[None, :]  # [NCB, 128]
    rmask = rows < R  # stores (padded rows included)
    mask = rmask[:, None, None] & (cols < C)[None, :, :]
    lmask = (rows < R_LD)[:, None, None] & (cols < C)[None, :, :]  # loads: real rows only, padding reads as 0.0
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None, None] * stride_x + cols[None, :, :], mask=lmask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    if COUNT_BAD:
        _count_non_finite(ax, bad_ptr)
    if not TRANSPOSE_OUT:
        if SQUARE:
            a = tl.maximum(tl.max(tl.max(ax, axis=2), axis=0), 0.0)  # [NCB]
            scale, sinv = _scale_from_amax(a, FMAX, IN_MAX, POW2)
            y = x * scale[None, :, None]
            cblk = pid_c * NCB + cb
            tl.store(sinv_ptr + pid_r.to(tl.int64) * stride_s + cblk, sinv, mask=cblk * 128 < C)
        else:
            a = tl.maximum(tl.max(ax, axis=2), 0.0)  # [BR, NCB]
            scale, sinv = _scale_from_amax(a, FMAX, IN_MAX, POW2)
            y = x * scale[:, :, None]
            cblk = pid_c * NCB + cb
            tl.store(sinv_ptr + r64[:, None] * stride_s + cblk[None, :].to(tl.int64) * stride_sc, sinv,
                     mask=rmask[:, None] & (cblk * 128 < C)[None, :])
        if E5M2:
            q = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(data_ptr + r64[:, None, None] * stride_d + cols[None, :, :], q, mask=mask)
    else:
        # blocks along R: one 128-row block per program (BLOCK_R == 128)
        if SQUARE:
            a = tl.maximum(tl.max(tl.max(ax, axis=2), axis=0), 0.0)  # [NCB]
            scale, sinv = _scale_from_amax(a, FMAX, IN_MAX, POW2)
            y = x * scale[None, :, None]
            cblk = pid_c * NCB + cb
            tl.store(sinv_ptr + cblk.to(tl.int64) * stride_s + pid_r, sinv, mask=cblk * 128 < C)
        else:
            a = tl.maximum(tl.max(ax, axis=0), 0.0)  # [NCB, 128]: one block per input column
            scale, sinv = _scale_from_amax(a, FMAX, IN_MAX, POW2)
            y = x * scale[None, :, :]
            tl.store(sinv_ptr + cols.to(tl.int64) * stride_s + pid_r, sinv, mask=cols < C)
        if E5M2:
            q = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if ROWCOL:  # the rowwise 1x128 copy of the same tile (real rows only, not transposed)
            ra = tl.maximum(tl.max(ax, axis=2), 0.0)  # [BR, NCB]
            rscale, rsinv = _scale_from_amax(ra, FMAX, IN_MAX, POW2)
            ry = x * rscale[:, :, None]
            if E5M2:
                rq = ry.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                rq = ry.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            rcblk = pid_c * NCB + cb
            tl.store(row_sinv_ptr + r64[:, None] * stride_rs + rcblk[None, :].to(tl.int64) * stride_rsc, rsinv,
                     mask=(rows < R_ROW)[:, None] & (rcblk * 128 < C)[None, :])
            tl.store(row_data_ptr + r64[:, None, None] * stride_rd + cols[None, :, :], rq,
                     mask=(rows < R_ROW)[:, None, None] & (cols < C)[None, :, :])
        # out[c, r] = q[r, c]: transpose the tile in registers so the store is row-contiguous in the output
        q2 = tl.reshape(q, (BLOCK_R, BLOCK_C))
        qt = tl.trans(q2)  # [BLOCK_C, BLOCK_R]
        cols_f = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        tmask = (cols_f < C)[:, None] & rmask[None, :]
        tl.store(data_ptr + cols_f.to(tl.int64)[:, None] * stride_d + rows[None, :], qt, mask=tmask)


def _pad(m: int, pad_rows_to: int) -> int:
    if not isinstance(pad_rows_to, int) or isinstance(pad_rows_to, bool) or pad_rows_to < 1:
        raise ValueError(f"pad_rows_to must be a positive int, got {pad_rows_to!r}")
    return -(-m // pad_rows_to) * pad_rows_to


def quantize(x2, element="e4m3", square=False, pow2=True, transpose=False, *, block_r=None, block_c=None,
             num_warps=4, out=None, bad=None, pad_rows_to=1):
    """FP8 block quantization of a contiguous [M, K] bf16/fp16/fp32 CUDA tensor.

    transpose=False: the recipe on x (axis="row"); transpose=True: on x.T (axis="col"), data [K, M].
    pad_rows_to: quantize x zero-padded to Mp = roundup(M, pad_rows_to) rows (the padding is never materialised:
    masked loads); data [Mp, K] / [K, Mp] and the scale grid of Mp rows. 1 (default): no padding.
    Returns (data uint8, scale_inv fp32 compact grid); `out` = (data, scale_inv) tensors of those shapes to write
    into instead of new ones. bad: an int32 CUDA tensor of one element that the NaN/Inf count of x is added to."""
    m, k = x2.shape
    mp = _pad(m, pad_rows_to)
    nw = num_warps if not (square or transpose) else 8
    data, sinv, _, _ = _launch(x2, mp, element, square, pow2, transpose, False, block_r, block_c, nw, out, None, bad)
    return data, sinv


def quantize_rowcol(x2, element="e4m3", pow2=True, pad_rows_to=128, *, block_c=None, num_warps=4, out=None,
                    out_row=None, bad=None, row_pad_to=1):
    """Both 1x128 copies of a contiguous [M, K] tensor from one read of x: the rowwise one (= quantize(x2, element,
    pow2=pow2): data [M, K], scale_inv [M, ceil(K/128)], never padded) and the columnwise one (= quantize(x2,
    element, pow2=pow2, transpose=True, pad_rows_to=pad_rows_to): data [K, Mp], scale_inv [K, ceil(Mp/128)]).
    Returns (row_data, row_scale_inv, col_data, col_scale_inv); out / out_row: (data, scale_inv) to write into.
    row_pad_to: the rowwise copy is that of x zero-padded to roundup(M, row_pad_to) <= Mp rows (default 1: none).
    num_warps=4: faster than 8 at every trainer shape on the H200 and faster than the two separate launches
    (benchmarks/fp8_operand_probe.py on the H200: 49152x3072 0.267 ms vs 0.398 ms with 8 warps, row + col 0.301)."""
    m, k = x2.shape
    mp = _pad(m, pad_rows_to)
    mr = _pad(m, row_pad_to)
    if mr > max(mp, m):
        raise ValueError(f"row_pad_to={row_pad_to} pads the row copy past the column copy's {mp} rows")
    data, sinv, rd, rs = _launch(x2, mp, element, False, pow2, True, True, None, block_c, num_warps, out, out_row,
                                 bad, row_rows=mr)
    return rd, rs, data, sinv


def _launch(x2, mp, element, square, pow2, transpose, rowcol, block_r, block_c, num_warps, out, out_row, bad,
            row_rows=None):
    import torch

    from ._common import LAUNCH_OPTS

    m, k = x2.shape
    dev = x2.device
    rr, cc = (k, mp) if transpose else (mp, k)  # shape of the quantized matrix
    if square:
        sgrid = (-(-rr // 128), -(-cc // 128))
    else:
        sgrid = (rr, -(-cc // 128))
    if out is not None:
        data, sinv = out
        if tuple(data.shape) != (rr, cc) or tuple(sinv.shape) != sgrid:
            raise ValueError(f"out: data {tuple(data.shape)} / scale_inv {tuple(sinv.shape)}, expected {(rr, cc)} / "
                             f"{sgrid}")
    else:
        data = torch.empty((rr, cc), dtype=torch.uint8, device=dev)
        sinv = torch.empty(sgrid, dtype=torch.float32, device=dev)
    rdata = rsinv = None
    if rowcol:
        if out_row is not None:
            rdata, rsinv = out_row
            want = (row_rows or m, k), (row_rows or m, -(-k // 128))
            if (tuple(rdata.shape), tuple(rsinv.shape)) != want:
                raise ValueError(f"out_row: data {tuple(rdata.shape)} / scale_inv {tuple(rsinv.shape)}, expected "
                                 f"{want[0]} / {want[1]}")
        else:
            rdata = torch.empty((row_rows or m, k), dtype=torch.uint8, device=dev)
            rsinv = torch.empty((row_rows or m, -(-k // 128)), dtype=torch.float32, device=dev)
    if mp and k:
        in_max = float(torch.finfo(x2.dtype).max)
        if transpose:
            br, bc = 128, block_c or 128
        elif square:
            br, bc = 128, block_c or 128
        else:
            br, bc = block_r or 8, block_c or 512
            bc = min(bc, max(128, 1 << (k - 1).bit_length()))
        grid = (triton.cdiv(mp, br), triton.cdiv(k, bc))
        rd_arg, rs_arg = (rdata, rsinv) if rowcol else (data, sinv)  # unused unless ROWCOL
        # only the 1x128 grids written row by row take a column stride (an outer-dim-major `out`); the others are
        # stored with unit column stride
        sc = sinv.stride(1) if sinv.dim() == 2 and sinv.shape[1] > 1 else 1
        if (transpose or square) and sc != 1:
            raise ValueError("a column-strided scale_inv `out` is for the non-transposed 1x128 grid only")
        rsc = rs_arg.stride(1) if rowcol and rs_arg.dim() == 2 and rs_arg.shape[1] > 1 else 1
        _fp8_block_kernel[grid](x2, data, sinv, bad if bad is not None else sinv, rd_arg, rs_arg, mp, m,
                                rd_arg.shape[0] if rowcol else m, k, x2.stride(0), data.stride(0), sinv.stride(0),
                                sc, rd_arg.stride(0), rs_arg.stride(0), rsc,
                                FMAX=FMAX[element], IN_MAX=in_max, E5M2=element == "e5m2", POW2=pow2, SQUARE=square,
                                TRANSPOSE_OUT=transpose, ROWCOL=rowcol, BLOCK_R=br, BLOCK_C=bc,
                                COUNT_BAD=bad is not None, num_warps=num_warps, **LAUNCH_OPTS)
    return data, sinv, rdata, rsinv
