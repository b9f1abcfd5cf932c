"""FP8 per-tensor current scaling reference (TE `Float8CurrentScaling`), E4M3 or E5M2.

Same scale rule as TE's FP8 block scaling (`compute_scale_from_amax` in common/recipe/recipe_common.cuh, TE
2.20.0.dev0 commit d0067d0; epsilon 0; fp32 scales - the current-scaling recipe does not force powers of two;
value_for_inf = FLT_MAX as in common/recipe/current_scaling.cu) with one block = the whole tensor. No golden vectors
exist for this format; its bytes follow from sharing `fp8_block.scale_from_amax` and the fp8 cast with the
golden-tested FP8-block reference (a tensor that is exactly one 128x128 tile gives identical bytes - tested).

Executable description (fp32, RN)::

    a = max |x| over the whole tensor (NaN ignored)
    scale = 1 if a == 0 / inf / NaN else RN(Fmax / a)   (a scale that overflows to inf -> FLT_MAX, whatever
                                                          the input dtype: TE recipe/current_scaling.cu)
    scale_inv = RN(1 / scale)                            # stored fp32, shape [1]
    q = fp8_rn_satfinite(RN(x * scale))
    decode: x ~= f32(q) * scale_inv

Layouts: axis="row": data uint8 [M, K]; axis="col": data of x.T, [K, M] (TE's columnwise / transpose copy; the
scale is the same). scale = scale_inv fp32 [1]. Edge cases as in fp8_block (zeros -> scale 1; -0.0 -> 0x80;
saturation by clamping; subnormals exact). Inputs: float32 / bfloat16 / float16, >= 1-D, any strides, empty allowed
(amax 0 -> scale 1).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..precision import FormatKind, TensorFormat
from ._numerics import FLT_MAX, FP8_MAX, abs_amax, as_2d_fp32, fp8_bytes_satfinite, fp8_bytes_to_f32, rn_div
from .base import FormatInputError, QuantizedTensor
from .fp8_block import scale_from_amax


KIND = FormatKind.FP8  # the format spec this module is the reference of (format_specs.SPECS)


def make_format(element: str = "e4m3") -> TensorFormat:
    return TensorFormat(kind=KIND, element=element, scale_dtype="fp32")  # type: ignore[arg-type]


def quantize(x: torch.Tensor, element: str = "e4m3", axis: str = "row",
             fmt: Optional[TensorFormat] = None) -> QuantizedTensor:
    what = f"fp8/{element} per-tensor (axis={axis})"
    if element not in FP8_MAX:
        raise FormatInputError(f"{what}: element must be 'e4m3' or 'e5m2', got {element!r}")
    if axis not in ("row", "col"):
        raise FormatInputError(f"{what}: axis must be 'row' or 'col', got {axis!r}")
    x2, shape = as_2d_fp32(x, what)
    amax = abs_amax(x2).reshape(1) if x2.numel() else torch.zeros(1, device=x2.device)
    scale = scale_from_amax(amax, element, pow2=False, value_for_inf=FLT_MAX)
    scale_inv = rn_div(1.0, scale)
    m2 = x2 if axis == "row" else x2.t()
    data = fp8_bytes_satfinite(m2 * scale, element).contiguous()
    return QuantizedTensor(fmt=fmt or make_format(element), shape=shape, data=data, scale=scale_inv,
                           axis=axis, orig_dtype=x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = fp8_bytes_to_f32(q.data, q.fmt.element) * q.scale
    if q.axis == "col":
        out = out.t()
    return out.reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, element: str = "e4m3", axis: str = "row",
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return dequantize(quantize(x, element, axis)).to(out_dtype or x.dtype)
