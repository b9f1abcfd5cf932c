"""Shared Triton building blocks of the fused quantize kernels (Hopper sm_90, no Blackwell-only PTX).

Exactness rules every kernel follows (the readable references in precision_dsl/formats/ are the oracle; their
docstrings cite the TransformerEngine kernels each one matches):
  * all arithmetic is IEEE fp32 RN without flush-to-zero. Plain Triton fp32 `*`, `+`, min/max lower to
    `mul.rn.f32` etc. (no .ftz). Divisions use `tl.math.div_rn` (libdevice `__nv_fdiv_rn`); libdevice picks its
    .ftz variant when Triton's `enable_reflect_ftz` option is on (the default in triton 3.6), so every launch passes
    LAUNCH_OPTS (`enable_reflect_ftz=False`: IEEE `div.rn.f32`, subnormal results kept). Triton's own fp32 `/` is
    the approximate `div.full.f32` and is never used.
  * FMA contraction is switched off (`enable_fp_fusion=False`) so that every product is rounded on its own.
  * fp32 -> fp8 casts (`.to(tl.float8e4nv / tl.float8e5)`) lower to `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32` on
    sm_89+: RNE, finite overflow and +-inf clamp to +-Fmax, NaN -> 0x7F.
  * block maxima use `tl.maximum` / `tl.max`, i.e. `max.f32`, which ignores NaN like the hardware max in TE's
    kernels; a final `max(., 0)` makes an all-NaN block 0.
  * E2M1 / E8M0 conversions are done with ordinary integer/float arithmetic (the Blackwell `cvt ... e2m1x2` and
    `cvt.rp.satfinite.ue8m0x2` instructions do not exist on sm_90a).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

# Keyword options added to every kernel launch (see module docstring). The interpreter (TRITON_INTERPRET=1)
# silently drops them; there numpy's division is IEEE anyway.
LAUNCH_OPTS = {"enable_reflect_ftz": False, "enable_fp_fusion": False}

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite fp32 (constexpr: usable inside kernels)

# Input dtype codes (constexpr): how pairs of elements are packed in one integer word.
IN_BF16 = 0
IN_FP16 = 1
IN_FP32 = 2


@triton.jit
def abs_max0(a, b):
    """NaN-ignoring max of |a|, |b| (max.f32)."""
    return tl.maximum(tl.abs(a), tl.abs(b))


@triton.jit
def max_nan(a, b):
    """max that propagates NaN (max.NaN.f32 on the GPU: one instruction, like the NaN-ignoring max.f32; the
    interpreter's np.maximum propagates NaN too)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def unpack_pair(u, IN_DTYPE: tl.constexpr):
    """Split one integer word holding elements (2j, 2j+1) of a row into two exact fp32 values (lo = element 2j).

    bf16/fp16 pairs arrive as int32 (little endian: element 2j in bits 0-15), fp32 pairs as int64. Loading pairs
    keeps the low/high nibble partners in the same thread, so packing two E2M1 codes per byte needs no reshape or
    split: the layout conversions a reshape/split costs would dominate a per-token kernel."""
    if IN_DTYPE == 0:
        lo = (u << 16).to(tl.float32, bitcast=True)
        hi = (u & -65536).to(tl.float32, bitcast=True)
    elif IN_DTYPE == 1:
        lo = (u & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (u >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = u.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (u >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def f32_const(bits: tl.constexpr):
    """fp32 constant from its bit pattern (no double -> float rounding questions)."""
    return tl.full([], bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code(y):
    """E2M1 code (int32 0..15) of fp32 y = RN(x * enc): RNE of min(|y|, 6), sign = (y < 0).

    Rounding to the E2M1 grid with one fp32 add: the grid spacing is 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6];
    c = 2^(e + 22) with e = max(floor(log2|y|), 0) has ulp(c) = spacing, so RN(|y| + c) = c + k * spacing with k the
    RNE multiple (ties to even k = ties to the even E2M1 code), and the code is k + 2e:
      e=0: k in {0,1,2,3,4} -> codes 0..4 (0, .5, 1, 1.5, 2);  e=1: k in {2,3,4} -> 4..6 (2, 3, 4);
      e=2: k in {2,3} -> 6, 7 (4, 6); |y| = 5 is a tie -> k = 2 -> 4 (even), > 5 -> 6.
    Adding C' = c + 2e ulps instead of c (same binade, same spacing, still on the grid) makes
    bits(RN(|y| + C')) - bits(c) the code directly (one integer subtraction, ~9 SASS instructions per element).
    NaN: min(NaN, 6) = 6 (max.f32 ignores NaN) -> code 7, the reference's choice. -0.0 -> code 0 (y < 0 is false),
    a negative y that rounds to zero -> code 8 (sign kept), as TE's Python reference."""
    a = tl.minimum(tl.abs(y), 6.0)
    e_bits = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000
    c_bits = e_bits + (22 << 23)
    cp_bits = c_bits + ((e_bits >> 22) - 254)  # c + 2e ulps
    s = a + cp_bits.to(tl.float32, bitcast=True)
    code = s.to(tl.int32, bitcast=True) - c_bits
    return code + tl.where(y < 0, 8, 0)


# E2M1_WORD_K = bits(2^22) - 2 * 127: cp = t * (2^23 + 2) + E2M1_WORD_K is bits(2^(t - 105)) + 2 * (t - 127)
E2M1_WORD_K = tl.constexpr((149 << 23) - 127 * (1 << 23) - 254)


@triton.jit
def e2m1_word(y):
    """int32 word whose low 8 bits are `e2m1_code(y)` (sign included: 0..15); bits 23-30 are C's exponent.

    The same single rounding add as e2m1_code, with the code read from the sum's low bits instead of subtracted
    out: with t = biased exponent of max(a, 1) (127..129, a = min(|y|, 6)) the addend C = 2^(t - 105) + 2(t - 127)
    ulps + 8 ulps if y < 0 lies in C's binade, so RN(a + C) = C + k ulps with k the RNE multiple (C is even, so
    ties go to even k) and bits(RN(a + C)) = bits(2^(t - 105)) + 8 * (y < 0) + 2(t - 127) + k: the low 23 bits
    of a power of two are 0 and 8 * sign + 2e + k <= 15 (no carry), so bits & 255 is the code. cp comes from t in one IMAD
    and the sign is folded into its addend, so no subtraction, no separate sign OR, and the mask merges into the
    nibble packing. -0.0 -> 0, NaN -> 7 and a negative y that rounds to 0 -> 8, exactly as e2m1_code."""
    a = tl.minimum(tl.abs(y), 6.0)
    t = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) >> 23
    cp = t * 0x800002 + tl.where(y < 0, E2M1_WORD_K + 8, E2M1_WORD_K)
    return (a + cp.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


# rcp.rn.f32 on the GPU; the interpreter has no libdevice and runs the division (same value: both IEEE RN).
# Decided once at import, as triton decides compiled vs interpreted when a kernel is decorated.
USE_RCP = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def rcp_rn(x):
    """RN(1 / x) in fp32: `rcp.rn.f32` (libdevice __nv_frcp_rn) when compiled, `div.rn.f32` 1/x (tl.math.div_rn)
    under the interpreter.

    Both are IEEE 754 correctly rounded (PTX ISA: rcp.rn.f32 and div.rn.f32 are IEEE compliant, subnormals
    supported; with enable_reflect_ftz=False libdevice picks the non-.ftz forms), so they agree on every input
    including 0 -> inf, inf -> 0, subnormal operands and results, and NaN; rcp.rn compiles to fewer instructions.
    tests/test_kernels.py compares the two on every positive fp32 on the GPU."""
    if USE_RCP:
        return libdevice.rcp_rn(x)
    else:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def e8m0_from_amax(amax, FMAX_RCP: tl.constexpr):
    """TE `float_to_e8m0(amax * RN(1/Fmax))` for a NaN-free amax >= 0: round toward +inf to a power of two,
    saturate finite. Returns (E as uint32 0..254, multiplier 2^(127-E) as fp32; E = 254 -> 2^-127 = 0x00400000,
    E = 0 -> 2^127).

    With u = bits(d): E = min((u + 0x7FFFFF) >> 23, 254) is exponent + (mantissa != 0) for normal d (the carry of
    a non-zero mantissa lands in the exponent), saturates exponent 254 and +inf to 254; subnormal d: E = 1 when
    d > 2^-127 (u > 0x400000), else 0 (TE's rule: d <= 2^-127 "rounds up" to 2^-127 itself). NaN d cannot occur
    (amax comes from a NaN-ignoring max with 0)."""
    d = amax * FMAX_RCP
    u = d.to(tl.uint32, bitcast=True)
    e = tl.minimum((u + 0x7FFFFF) >> 23, 254)
    e = tl.where(u <= 0x400000, 0, e)
    s_bits = tl.where(e == 254, 0x00400000, (254 - e) << 23)
    return e, s_bits.to(tl.float32, bitcast=True)


def in_dtype_code(dtype) -> int:
    import torch

    return {torch.bfloat16: IN_BF16, torch.float16: IN_FP16, torch.float32: IN_FP32}[dtype]


def pair_view(x2):
    """[M, K] contiguous bf16/fp16/fp32 -> integer view [M, K/2] of element pairs (int32 or int64)."""
    import torch

    return x2.view(torch.int64 if x2.dtype == torch.float32 else torch.int32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
