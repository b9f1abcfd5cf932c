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
def _fp8_block_kernel(x_ptr, data_ptr, sinv_ptr, bad_ptr, R, C, stride_x, stride_d, stride_s, FMAX: tl.constexpr,
                      IN_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, SQUARE: tl.constexpr,
                      TRANSPOSE_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      COUNT_BAD: tl.constexpr):
    """x: [R, C]. Not transposed: blocks of 1x128 (SQUARE=False) or 128x128 along C; data [R, C], scale_inv
    [R, ceil(C/128)] or [ceil(R/128), ceil(C/128)]. TRANSPOSE_OUT: blocks of 128x1 / 128x128 along R (BLOCK_R must
    be 128); data [C, R] (= quantization of x.T), scale_inv [C, ceil(R/128)] or [ceil(C/128), ceil(R/128)].
    COUNT_BAD: add the tile's NaN/Inf count to *bad_ptr (the weight update's refusal, in the same read of x)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    NCB: tl.constexpr = BLOCK_C // 128
    cb = tl.arange(0, NCB)
    ci = tl.arange(0, 128)
    cols = pid_c * BLOCK_C + cb[:, None] * 128 + ci[None, :]  # [NCB, 128]
    rmask = rows < R
    mask = rmask[:, None, None] & (cols < C)[None, :, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None, None] * stride_x + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
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
            tl.store(sinv_ptr + r64[:, None] * stride_s + cblk[None, :], sinv,
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
        # out[c, r] = q[r, c]: transpose the tile in registers so the store is row-contiguous in the output
        q2 = tl.reshape(q, (BLOCK_R, BLOCK_C))
        qt = tl.trans(q2)  # [BLOCK_C, BLOCK_R]
        cols_f = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        tmask = (cols_f < C)[:, None] & rmask[None, :]
        tl.store(data_ptr + cols_f.to(tl.int64)[:, None] * stride_d + rows[None, :], qt, mask=tmask)


def quantize(x2, element="e4m3", square=False, pow2=True, transpose=False, *, block_r=None, block_c=None,
             num_warps=4, out=None, bad=None):
    """FP8 block quantization of a contiguous [M, K] bf16/fp16/fp32 CUDA tensor.

    transpose=False: the recipe on x (axis="row"); transpose=True: on x.T (axis="col"), data [K, M].
    Returns (data uint8, scale_inv fp32 compact grid); `out` = (data, scale_inv) tensors of those shapes to write
    into instead of new ones. bad: an int32 CUDA tensor of one element that the NaN/Inf count of x is added to."""
    import torch

    from ._common import LAUNCH_OPTS

    m, k = x2.shape
    dev = x2.device
    rr, cc = (k, m) if transpose else (m, k)  # shape of the quantized matrix
    if square:
        sgrid = (-(-rr // 128), -(-cc // 128))
    else:
        sgrid = (rr, -(-cc // 128))
    if out is not None:
        data, sinv = out
    else:
        data = torch.empty((rr, cc), dtype=torch.uint8, device=dev)
        sinv = torch.empty(sgrid, dtype=torch.float32, device=dev)
    if m and k:
        in_max = float(torch.finfo(x2.dtype).max)
        if transpose:
            br, bc = 128, block_c or 128
        elif square:
            br, bc = 128, block_c or 128
        else:
            br, bc = block_r or 8, block_c or 512
            bc = min(bc, max(128, 1 << (k - 1).bit_length()))
        grid = (triton.cdiv(m, br), triton.cdiv(k, bc))
        _fp8_block_kernel[grid](x2, data, sinv, bad if bad is not None else sinv, m, k, x2.stride(0), data.stride(0),
                                sinv.stride(0), FMAX=FMAX[element], IN_MAX=in_max, E5M2=element == "e5m2", POW2=pow2,
                                SQUARE=square, TRANSPOSE_OUT=transpose, BLOCK_R=br, BLOCK_C=bc,
                                COUNT_BAD=bad is not None,
                                num_warps=num_warps if not (square or transpose) else 8, **LAUNCH_OPTS)
    return data, sinv
