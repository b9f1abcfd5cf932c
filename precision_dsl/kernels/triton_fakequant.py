"""Fused MXFP8 fake quantization (Triton): x -> dequantize(quantize(x)) written as bf16 in ONE pass; and a one-pass
NVFP4 element decode (packed E2M1 codes x E4M3 block scale -> bf16, the second-level S_dec left to the caller).

The trainer's emulated GEMMs only need the dequantized operand. Quantize kernel + separate decode reads and writes
the tensor ~4 times (x, fp8 bytes, E8M0 scales, decoded values); this kernel reads x once and writes the decoded
values once. Per block it runs the very same code as the quantize kernel (triton_mxfp8: `e8m0_from_amax`,
`_to_fp8_bytes` = cvt.rn.satfinite) and then decodes the byte: f32(fp8) * 2^(E-127), rounded to bf16.
Exactness: f32(fp8) has <= 4 significant bits, times a power of two it is exact in fp32 and in bf16, except in
blocks with E8M0 < 3 (block amax below ~2^-116), whose E4M3 subnormals fall under bf16's smallest subnormal 2^-133
and are rounded (documented in engine/fastgemm.py). Output = bf16 of formats.mxfp8.fake_quantize's fp32 values,
tested bitwise (tests/test_engine_fastgemm.py, on CPU under TRITON_INTERPRET=1 and on the H200).

axis="row": 1x32 blocks along K (needs K % 32 == 0); axis="col": 32x1 blocks along M, any M (rows past M are
masked to zero, i.e. exactly the zero padding the reference applies to a partial column block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LAUNCH_OPTS, e8m0_from_amax
from .triton_mxfp8 import FMAX_RCP, _to_fp8_bytes


@triton.jit
def _fp8_byte_value(q, E5M2: tl.constexpr):
    """fp32 value of an fp8 byte (int32 0..255), by integer arithmetic: (implicit bit + mantissa) x 2^p, both
    factors exact (decoding with an fp8 bitcast is not reliable under the interpreter). NaN bytes -> NaN."""
    if E5M2:
        ex = (q >> 2) & 31
        mn = q & 3
        m_int = tl.where(ex > 0, mn + 4, mn)
        p = tl.where(ex > 0, ex - 17, -16)
        nan = ex == 31  # satfinite never writes inf: only the NaN byte lands here
    else:
        ex = (q >> 3) & 15
        mn = q & 7
        m_int = tl.where(ex > 0, mn + 8, mn)
        p = tl.where(ex > 0, ex - 10, -9)
        nan = (q & 0x7F) == 0x7F
    v = m_int.to(tl.float32) * ((p + 127) << 23).to(tl.float32, bitcast=True)
    # the sign by its bit: Triton's unary minus is 0 - v, which turns the -0.0 byte (0x80) into +0.0
    v = (v.to(tl.int32, bitcast=True) | ((q & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where(nan, float("nan"), v)


@triton.jit
def _mxfp8_fq_kernel(x_ptr, o_ptr, M, K, stride_x, stride_o, FMAX_RCP: tl.constexpr, E5M2: tl.constexpr,
                     COL: tl.constexpr, NKB: tl.constexpr):
    """One 32-row stripe x 32*NKB columns per program, as a 3-D [32 rows, NKB, 32 cols] block."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, 32)
    kb = tl.arange(0, NKB)
    c = tl.arange(0, 32)
    rows = pid_m * 32 + r[:, None, None]
    cols = (pid_k * NKB + kb)[None, :, None] * 32 + c[None, None, :]
    mask = (rows < M) & (cols < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    if COL:
        amax = tl.maximum(tl.max(ax, axis=0), 0.0)  # [NKB, 32]: over the 32 rows of the stripe
        e, s = e8m0_from_amax(amax, FMAX_RCP)
        e = e[None, :, :]
        s = s[None, :, :]
    else:
        amax = tl.maximum(tl.max(ax, axis=2), 0.0)  # [32, NKB]: over the 32 columns of each block
        e, s = e8m0_from_amax(amax, FMAX_RCP)
        e = e[:, :, None]
        s = s[:, :, None]
    v = _fp8_byte_value(_to_fp8_bytes(x * s, E5M2).to(tl.int32), E5M2)
    dec = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)  # 2^(E-127), E <= 254
    tl.store(o_ptr + rows64 * stride_o + cols, (v * dec).to(tl.bfloat16), mask=mask)


def mxfp8_fake_quantize_bf16(x2, element: str = "e4m3", axis: str = "row", nkb: int = 4, num_warps: int = 4):
    """bf16 [M, K] = mxfp8 fake-quant of a contiguous [M, K] fp32/bf16/fp16 tensor (CUDA, or CPU under
    TRITON_INTERPRET=1). K % 32 == 0 required (checked by the caller, as by the quantize kernel)."""
    import torch

    m, k = x2.shape
    out = torch.empty((m, k), dtype=torch.bfloat16, device=x2.device)
    if m and k:
        grid = (triton.cdiv(m, 32), triton.cdiv(k // 32, nkb))
        _mxfp8_fq_kernel[grid](x2, out, m, k, x2.stride(0), out.stride(0), FMAX_RCP=FMAX_RCP[element],
                               E5M2=element == "e5m2", COL=axis == "col", NKB=nkb, num_warps=num_warps,
                               **LAUNCH_OPTS)
    return out


@triton.jit
def _nvfp4_decode_kernel(d_ptr, s_ptr, o_ptr, R, C, stride_d, stride_s, stride_o, BR: tl.constexpr,
                         BC: tl.constexpr):
    """out[r, c] = e2m1(code of element c) * f32(E4M3 scale of block c // 16): exact in bf16 (<= 2 x 4 significant
    bits, smallest magnitude 0.5 * 2^-9). Code c: magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}[c & 7], sign c & 8 (code 8
    = -0.0, as the reference LUT)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    cols = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    mask = (rows < R) & (cols < C)
    rows64 = rows.to(tl.int64)
    byte = tl.load(d_ptr + rows64 * stride_d + cols // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)) & 15
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    v = tl.where(e == 0, m.to(tl.float32) * 0.5,
                 (m + 2).to(tl.float32) * ((e - 2 + 127) << 23).to(tl.float32, bitcast=True))
    v = (v.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # sign bit (-0.0 kept)
    sf = _fp8_byte_value(tl.load(s_ptr + rows64 * stride_s + cols // 16, mask=mask, other=0).to(tl.int32), False)
    tl.store(o_ptr + rows64 * stride_o + cols, (v * sf).to(tl.bfloat16), mask=mask)


def nvfp4_decode_bf16(data, scale, br: int = 16, bc: int = 256, num_warps: int = 4):
    """bf16 [R, C] = E2M1 elements x E4M3 1x16 block scales of a rowwise NVFP4 tensor (data uint8 [R, C/2], low
    nibble = even element; scale uint8 E4M3 bytes [R, C/16]); S_dec is NOT applied (fp32, not bf16-exact)."""
    import torch

    r, c = data.shape[0], data.shape[1] * 2
    out = torch.empty((r, c), dtype=torch.bfloat16, device=data.device)
    if r and c:
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _nvfp4_decode_kernel[grid](data, scale, out, r, c, data.stride(0), scale.stride(0), out.stride(0), BR=br,
                                   BC=bc, num_warps=num_warps, **LAUNCH_OPTS)
    return out
