"""MXFP8 reference quantizer (OCP MX block format, NVIDIA TransformerEngine's rule), bit-exact to TE.

Source of truth: TransformerEngine 2.20.0.dev0 (commit d0067d0), `quantize_mxfp8_kernel`
(common/cast/mxfp8/quantize_mxfp8.cuh), `float_to_e8m0` (common/util/ptx_arch_spec.cuh), `exp2f_rcp`
(common/util/ptx.cuh) and the C++ test reference `compute_ref` / `compute_ref_2d_quantize`
(tests/cpp/operator/test_cast_mxfp8.cu). Golden vectors: ../shared/golden/quantizers/mxfp8__*.
This is torchao's `to_mx(..., ScaleCalculationMode.RCEIL)` for finite inputs; it is NOT the OCP FLOOR rule.

Element formats: E4M3 (`float8_e4m3fn`, Fmax = 448) or E5M2 (`float8_e5m2`, Fmax = 57344).
Scale: one E8M0 byte E per block, value 2^(E-127) (E = 255 is NaN, E = 0 is 2^-127, not zero).

Blocks over the 2-D view x[M, K] (K = last dim):
  * rowwise  1x32 (axis="row"): block x[i, 32j:32j+32]; data [M, K] uint8, scale [M, K/32]
  * colwise 32x1  (axis="col"): block x[32i:32i+32, j]; data [M, K] uint8 (NOT transposed, TE's layout),
    scale [M/32, K]
  * 2D      32x32 (tile_2d=True): data [M, K], scale [M/32, K/32] (TE replicates it per row / per column;
    its rowwise and columnwise data are both equal to this data)
Scales are compact and unswizzled; `swizzle.swizzle_128x4` gives the GEMM (cuBLAS 32_4_4) layout.

Executable description of one block B (all fp32, RN = round-to-nearest-even, no FTZ)::

    a = max(|x| for x in B if not isnan(x))          # hardware max ignores NaN; all-NaN / empty block -> 0
    d = RN(a * RN(1/Fmax))                           # TE Quantized_Limits::max_norm_rcp (same E as RN(a/Fmax))
    E = e8m0_round_up_satfinite(d):
          d is NaN -> 255 ; d == +inf -> 254 ; d == 0 -> 0
          exponent field e, mantissa field m of d:
          e == 0   (subnormal) -> 1 if m > 0x400000 else 0     # d <= 2^-127 rounds "up" to 2^-127 itself
          e == 254             -> 254                          # saturate, never 255 for finite d
          else                 -> e + (m != 0)                  # round toward +inf to a power of two
    s = 2^(127 - E) as fp32                          # E = 254 -> 2^-127 (subnormal 0x00400000); E = 0 -> 2^127
    q = fp8_rn_satfinite(RN(x * s))                  # clamp to +-Fmax then RNE cast; NaN -> byte 0x7F
    decode: x ~= f32(q) * 2^(E - 127)

Edge cases (all covered by golden vectors):
  * zeros: an all-zero block has E = 0 and bytes 0x00 (0x80 for -0.0: the sign of zero is kept);
  * tiny blocks, a <= 448 * 2^-127 ~ 2.6e-36: E = 0 and the bytes are RN(x * 2^127), non-zero (FlashInfer
    writes zeros there instead); near a ~ 2.6331e-36 x * s exceeds Fmax by an ulp -> the clamp saturates it;
  * ties: RNE in the fp8 cast (e.g. 448 * 2^k * (1 + 1/16) style midpoints go to the even mantissa);
  * saturation: finite overflow and +-inf -> +-Fmax (0x7E / 0xFE for E4M3, 0x7B / 0xFB for E5M2);
  * subnormal fp32 / bf16 inputs are exact (no flush-to-zero);
  * NaN: ignored by the block amax; a NaN element becomes byte 0x7F whatever its sign or payload (TE's C++
    reference; torch's own cast would keep the sign -> 0xFF);
  * +-inf: the block amax is inf -> E = 254 (0xFE), s = 2^-127, +-inf -> +-Fmax, finite elements -> ~+-0.

Shapes: rowwise needs K % 32 == 0, colwise needs M % 32 == 0, 2D needs both (TE raises the same way). Inputs:
float32 / bfloat16 / float16, >= 1-D (flattened to [M, K]), any strides (copied to contiguous), empty allowed.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..precision import FormatKind, TensorFormat
from ._numerics import (
    FP8_MAX,
    NAN_BYTE,
    abs_amax_nan,
    as_2d_fp32,
    f32_bits,
    f32_from_bits,
    fp8_bytes_satfinite,
    fp8_bytes_to_f32,
    require_divisible,
    rn_div,
)
from .base import FormatInputError, QuantizedTensor

BLOCK = 32
E8M0_NAN = 255
KIND = FormatKind.MXFP8  # the format spec this module is the reference of (format_specs.SPECS)


def make_format(element: str = "e4m3", tile_2d: bool = False) -> TensorFormat:
    return TensorFormat(kind=KIND, element=element, block=(32, 32) if tile_2d else (1, 32),
                        scale_dtype="e8m0")


def e8m0_round_up_satfinite(d: torch.Tensor) -> torch.Tensor:
    """TE `float_to_e8m0` (== PTX cvt.rp.satfinite.ue8m0x2.f32) for fp32 d >= 0 -> uint8 E8M0 bytes.

    Rule (exponent field e, mantissa field m of d): NaN -> 255; +inf -> 254; e == 0 (zero / subnormal) ->
    1 if m > 0x400000 else 0; e == 254 -> 254; else e + (m != 0).
    Computed on the bit pattern: adding 0x7FFFFF carries into the exponent field exactly when m != 0 (0x3FFFFF for
    subnormals, which carries exactly when m > 0x400000); the clamp to 254 covers e == 254 and +inf."""
    bits = f32_bits(d.float())
    bump = torch.where(bits < 0x00800000, 0x3FFFFF, 0x7FFFFF)  # zero/subnormal vs normal/inf
    e = ((bits + bump) >> 23).clamp_(0, 254)
    e = e.masked_fill_(torch.isnan(d), E8M0_NAN)
    return e.to(torch.uint8)


def e8m0_to_multiplier(e: torch.Tensor) -> torch.Tensor:
    """TE `exp2f_rcp`: fp32 2^(127 - E). E = 255 -> NaN, E = 254 -> 2^-127 (0x00400000), else bits (254-E)<<23."""
    ei = e.to(torch.int32)
    bits = torch.where(ei >= 254, 0x00400000, (254 - ei) << 23)
    return f32_from_bits(bits.masked_fill_(ei == 255, 0x7FC00000))


def e8m0_to_scale(e: torch.Tensor) -> torch.Tensor:
    """Decode scale 2^(E - 127) as fp32 (E = 0 -> 2^-127, subnormal 0x00400000; E = 255 -> NaN)."""
    ei = e.to(torch.int32)
    bits = torch.where(ei == 0, 0x00400000, ei << 23)
    return f32_from_bits(bits.masked_fill_(ei == 255, 0x7FC00000))


def scale_from_amax(amax: torch.Tensor, element: str) -> torch.Tensor:
    """E8M0 byte per block from the block amax (TE: d = RN(amax * RN(1/Fmax)), round up, saturate)."""
    fmax_rcp = rn_div(1.0, torch.full((), FP8_MAX[element], dtype=torch.float32, device=amax.device))
    return e8m0_round_up_satfinite(amax.float() * fmax_rcp)


def _check_args(element: str, axis: str) -> None:
    if element not in FP8_MAX:
        raise FormatInputError(f"mxfp8: element must be 'e4m3' or 'e5m2', got {element!r}")
    if axis not in ("row", "col"):
        raise FormatInputError(f"mxfp8: axis must be 'row' or 'col', got {axis!r}")


def _blocked_view(x2: torch.Tensor, axis: str, tile_2d: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """View x2 [M, K] with one block per reduced group: returns (view, dims to reduce)."""
    m, k = x2.shape
    if tile_2d:
        return x2.view(m // BLOCK, BLOCK, k // BLOCK, BLOCK), (1, 3)
    if axis == "row":
        return x2.view(m, k // BLOCK, BLOCK), (2,)
    return x2.view(m // BLOCK, BLOCK, k), (1,)


def _check_shape(what: str, m: int, k: int, axis: str, tile_2d: bool) -> None:
    hint = ("pad it with zeros to a multiple of 32 (TE's MXFP8Quantizer rejects such tensors too) or give this "
            "tensor a format without 32-element blocks (e.g. bf16 or fp8 per-tensor)")
    if tile_2d or axis == "row":
        require_divisible(what, "K (last dim)", k, BLOCK, hint)
    if tile_2d or axis == "col":
        require_divisible(what, "M (product of leading dims)", m, BLOCK, hint)


def _quantize_2d(x2: torch.Tensor, element: str, axis: str, tile_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [M, K], E8M0 scale bytes) of a validated fp32 matrix."""
    xb, dims = _blocked_view(x2, axis, tile_2d)
    amax, has_nan = abs_amax_nan(xb, dim=dims, keepdim=True)
    e = scale_from_amax(amax, element)
    s = e8m0_to_multiplier(e)
    data = fp8_bytes_satfinite(xb * s, element, nan_byte=NAN_BYTE if has_nan else None).reshape(x2.shape)
    scale = e.squeeze(dims[-1])
    if tile_2d:
        scale = scale.squeeze(1)
    return data, scale.contiguous()


def quantize(x: torch.Tensor, element: str = "e4m3", axis: str = "row", tile_2d: bool = False,
             fmt: Optional[TensorFormat] = None) -> QuantizedTensor:
    """Quantize `x` to MXFP8 exactly as TE does. See the module docstring for layouts and edge cases.

    axis="row": 1x32 blocks along K; axis="col": 32x1 blocks along M (data stays [M, K]); tile_2d=True: 32x32."""
    _check_args(element, axis)
    what = f"mxfp8/{element} {'32x32' if tile_2d else ('1x32' if axis == 'row' else '32x1')}"
    orig_dtype = x.dtype if isinstance(x, torch.Tensor) else None
    x2, shape = as_2d_fp32(x, what)
    m, k = x2.shape
    _check_shape(what, m, k, axis, tile_2d)
    data, scale = _quantize_2d(x2, element, axis, tile_2d)
    return QuantizedTensor(fmt=fmt or make_format(element, tile_2d), shape=shape, data=data, scale=scale,
                           axis=axis, orig_dtype=orig_dtype)


def _is_2d(q: QuantizedTensor) -> bool:
    return q.fmt.block == (32, 32)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ~= f32(data) * 2^(E - 127), computed in fp32, returned in `dtype` with the original shape."""
    element = q.fmt.element
    tile_2d = _is_2d(q)
    vals = fp8_bytes_to_f32(q.data, element)
    m, k = vals.shape
    vb, dims = _blocked_view(vals, q.axis, tile_2d)
    dec = e8m0_to_scale(q.scale)
    if tile_2d:
        dec = dec.view(m // BLOCK, 1, k // BLOCK, 1)
    else:
        dec = dec.unsqueeze(dims[0])
    return (vb * dec).reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, element: str = "e4m3", axis: str = "row", tile_2d: bool = False,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dequantize(quantize(x)) in `out_dtype` (default x.dtype), without building the QuantizedTensor (same bits)."""
    _check_args(element, axis)
    what = f"mxfp8/{element} fake_quantize"
    x2, shape = as_2d_fp32(x, what)
    m, k = x2.shape
    _check_shape(what, m, k, axis, tile_2d)
    xb, dims = _blocked_view(x2, axis, tile_2d)
    amax, has_nan = abs_amax_nan(xb, dim=dims, keepdim=True)
    e = scale_from_amax(amax, element)
    data = fp8_bytes_satfinite(xb * e8m0_to_multiplier(e), element, nan_byte=NAN_BYTE if has_nan else None)
    out = fp8_bytes_to_f32(data, element) * e8m0_to_scale(e)
    return out.reshape(shape).to(out_dtype or x.dtype)
