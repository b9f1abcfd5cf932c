"""One-pass decode kernels for the trainer's emulated GEMMs (Triton): quantized bytes -> bf16 operand values.

The trainer's emulated GEMMs need the dequantized operand in bf16 (exact: see engine/fastgemm.py). The quantize
kernels (triton_mxfp8 / triton_nvfp4, byte-exact to the references) write bytes + scales; these kernels read them
once and write the bf16 values once, instead of ~4 eager torch passes (fp8 view -> float -> times scale -> bf16):
  * MXFP8: f32(fp8 byte) * 2^(E-127), rowwise (1x32 blocks along K, scale [M, K/32]) or columnwise (32x1 blocks
    along M, data not transposed, scale [M/32, K]); exact in fp32 and in bf16 except in blocks with E8M0 < 3 (block
    amax below ~2^-116), whose E4M3 subnormals fall under bf16's smallest subnormal 2^-133 (documented in
    engine/fastgemm.py).
  * NVFP4: E2M1 element x E4M3 block scale (the second-level S_dec is left to the GEMM epilogue).
Bytes are decoded by integer arithmetic (`_fp8_byte_value`), signs by their bit (Triton's unary minus is 0 - v and
would turn -0.0 into +0.0). Outputs are bitwise the references' dequantized values (rounded to bf16, exact), tested
on CPU under TRITON_INTERPRET=1 (tests/decode_interpreted.py) and on the H200 (tests/test_engine_fastgemm.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LAUNCH_OPTS


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
def _mxfp8_decode_kernel(d_ptr, s_ptr, o_ptr, R, C, stride_d, stride_s, stride_o, E5M2: tl.constexpr,
                         COL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """out[r, c] = f32(fp8 byte d[r, c]) * 2^(E - 127), E = scale[r, c // 32] (rowwise) or scale[r // 32, c]."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    cols = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    mask = (rows < R) & (cols < C)
    rows64 = rows.to(tl.int64)
    q = tl.load(d_ptr + rows64 * stride_d + cols, mask=mask, other=0).to(tl.int32)
    if COL:
        e = tl.load(s_ptr + (rows64 // 32) * stride_s + cols, mask=mask, other=127).to(tl.int32)
    else:
        e = tl.load(s_ptr + rows64 * stride_s + cols // 32, mask=mask, other=127).to(tl.int32)
    dec = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)  # 2^(E-127); E = 0 -> 2^-127
    dec = tl.where(e == 255, float("nan"), dec)
    v = _fp8_byte_value(q, E5M2) * dec
    tl.store(o_ptr + rows64 * stride_o + cols, v.to(tl.bfloat16), mask=mask)


def mxfp8_decode_bf16(data, scale, element: str = "e4m3", axis: str = "row", br: int = 16, bc: int = 256,
                      num_warps: int = 4):
    """bf16 [R, C] of an MXFP8 tensor's bytes (uint8 [R, C]) and E8M0 scales (uint8 [R, C/32] rowwise, [R/32, C]
    columnwise, the data not transposed), CUDA or CPU under TRITON_INTERPRET=1."""
    import torch

    r, c = data.shape
    out = torch.empty((r, c), dtype=torch.bfloat16, device=data.device)
    if r and c:
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _mxfp8_decode_kernel[grid](data, scale, out, r, c, data.stride(0), scale.stride(0), out.stride(0),
                                   E5M2=element == "e5m2", COL=axis == "col", BR=br, BC=bc, num_warps=num_warps,
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
