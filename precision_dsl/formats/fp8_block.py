"""FP8 block-scaling reference quantizer (TE `Float8BlockScaling` / DeepSeek-V3 style), bit-exact to TE.

Source of truth: TransformerEngine 2.20.0.dev0 (commit d0067d0): `compute_scale_from_amax`
(common/recipe/recipe_common.cuh), kernels common/transpose/quantize_transpose_{square,vector}_blockwise.cu and the
Python reference `BlockwiseQuantizerReference` (tests/pytorch/references/blockwise_quantizer_reference.py,
quantize_scale_calc.py) that produced ../shared/golden/quantizers/fp8block__*. DeepSeek-V3's published Triton
kernels divide with approximate Triton division, so "DeepSeek-style" is not one bit-exact rule; TE's is canonical
here. Checkpoint convention (DeepSeek-V3 `*.weight_scale_inv`): fp32 scale_inv, dequant = q * scale_inv.

Blocks over the 2-D view x[M, K]: 1x128 (activations / grads, `block=(1, 128)`) or 128x128 (weights). Partial
blocks at the end of a dim are allowed; their amax is over the valid elements only (TE zero-pads).
Layouts (compact, non-transposed scale grid, as DeepSeek checkpoints store it):
  * axis="row": data uint8 [M, K]; scale_inv fp32 [M, ceil(K/128)] (1x128) or [ceil(M/128), ceil(K/128)] (128x128)
  * axis="col": the same recipe applied to x.T (TE's columnwise copy IS transposed): data [K, M],
    scale_inv [K, ceil(M/128)] or [ceil(K/128), ceil(M/128)]
(TE's own storage pads/transposes the scale grid: 1x128 -> [ceil(K/128), roundup(M,4)]; not reproduced here.)

Executable description of one block B (fp32, RN = round-to-nearest-even, IEEE division)::

    a = max |x| over B
    if a == 0 or a is inf or a is NaN:  scale = 1
    else:
        scale = RN(Fmax / a)                            # __fdiv_rn; Fmax = 448 (E4M3) or 57344 (E5M2)
        if scale == inf: scale = max finite of the INPUT dtype   # fp32 3.4028235e38, bf16 3.3895314e38,
                                                                  # fp16 65504
        if pow2: scale = bits(scale) & 0xFF800000       # keep sign + exponent = floor to a power of two
    scale_inv = RN(1 / scale)                           # stored fp32
    q = fp8_rn_satfinite(RN(x * scale))                 # multiply by scale (not divide by scale_inv), clamp +-Fmax
    decode: x ~= f32(q) * scale_inv

Edge cases: all-zero block -> scale 1, scale_inv 1, bytes 0x00 / 0x80 (-0.0 keeps its sign); tiny amax (Fmax/a
overflows) -> scale = input-dtype max (pow2: 2^127 for fp32 and bf16), scale_inv its reciprocal (possibly an fp32
subnormal); subnormal inputs exact; ties RNE; saturation by clamping. NaN / Inf inputs are outside the bit-exact
contract (TE's references disagree); here NaN is ignored by the amax, a NaN element becomes byte 0x7F whatever its
sign or payload (what `cvt.rn.satfinite` writes, so TE's kernels and ours; torch's own cast keeps the sign, and
torch's fp32 -> bf16 cast makes NaN negative: 0xFFFF), and +-inf makes the block's scale 1 and saturates to +-Fmax.

Inputs: float32 / bfloat16 / float16, >= 1-D (flattened to [M, K]), any strides (copied), empty allowed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..format_specs import FP8_BLOCK_SPEC
from ..precision import FormatKind, TensorFormat
from ._numerics import FP8_MAX, NAN_BYTE, abs_amax_nan, as_2d_fp32, f32_bits, f32_from_bits, \
    fp8_bytes_satfinite, fp8_bytes_to_f32, rn_div
from .base import FormatInputError, QuantizedTensor

BLOCK = 128
BLOCKS = FP8_BLOCK_SPEC.blocks  # (1, 128), (128, 128)
KIND = FormatKind.FP8_BLOCK  # the format spec this module is the reference of (format_specs.SPECS)


def make_format(element: str = "e4m3", block: tuple[int, int] = (1, 128), pow2: bool = True) -> TensorFormat:
    return TensorFormat(kind=KIND, element=element, block=block,
                        scale_dtype="pow2" if pow2 else "fp32")  # type: ignore[arg-type]


def scale_from_amax(amax: torch.Tensor, element: str, pow2: bool, value_for_inf: float) -> torch.Tensor:
    """TE `compute_scale_from_amax` (epsilon = 0): fp32 scale per block. `value_for_inf` replaces a scale that
    overflows to inf: the input dtype's max finite value for block scaling (TE `TypeInfo<IType>::max_finite_value`),
    FLT_MAX for per-tensor current scaling (TE recipe/current_scaling.cu)."""
    a = amax.float()
    scale = rn_div(FP8_MAX[element], a)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    degenerate = (a == 0) | torch.isinf(a) | torch.isnan(a)
    scale = torch.where(degenerate, torch.ones_like(scale), scale)
    if pow2:
        scale = f32_from_bits(f32_bits(scale) & -8388608)  # & 0xFF800000 (int32)
    return scale


def _check(element: str, block, axis: str, what: str) -> tuple[int, int]:
    if element not in FP8_MAX:
        raise FormatInputError(f"{what}: element must be 'e4m3' or 'e5m2', got {element!r}")
    block = tuple(block) if isinstance(block, (tuple, list)) else block
    if block not in BLOCKS:
        raise FormatInputError(f"{what}: block must be (1, 128) or (128, 128), got {block}")
    if axis not in ("row", "col"):
        raise FormatInputError(f"{what}: axis must be 'row' or 'col', got {axis!r}")
    return block  # type: ignore[return-value]


def _quantize_matrix(m2: torch.Tensor, element: str, block: tuple[int, int], pow2: bool, in_dtype: torch.dtype):
    """fp32 [R, C] -> (data uint8 [R, C], scale fp32 grid, scale_inv fp32 grid)."""
    r, c = m2.shape
    br, bc = block
    nr, nc = -(-r // br), -(-c // bc)
    pr, pc = nr * br - r, nc * bc - c
    padded = F.pad(m2, (0, pc, 0, pr)) if (pr or pc) else m2  # zero padding does not change a block's amax
    blocks = padded.view(nr, br, nc, bc)
    amax, has_nan = abs_amax_nan(blocks, dim=(1, 3))  # [nr, nc]
    scale = scale_from_amax(amax, element, pow2, torch.finfo(in_dtype).max)
    scale_inv = rn_div(1.0, scale)
    data = fp8_bytes_satfinite(blocks * scale.view(nr, 1, nc, 1), element, nan_byte=NAN_BYTE if has_nan else None)
    data = data.view(nr * br, nc * bc)[:r, :c].contiguous()
    return data, scale, scale_inv


def quantize(x: torch.Tensor, element: str = "e4m3", block: tuple[int, int] = (1, 128), pow2: bool = True,
             axis: str = "row", fmt: Optional[TensorFormat] = None) -> QuantizedTensor:
    """Quantize `x` with TE Float8BlockScaling (see module docstring). `QuantizedTensor.scale` holds scale_inv."""
    what = f"fp8_block/{element} block={tuple(block) if isinstance(block, (tuple, list)) else block} " \
           f"{'pow2' if pow2 else 'fp32'} (axis={axis})"
    block = _check(element, block, axis, what)
    x2, shape = as_2d_fp32(x, what)
    m2 = x2 if axis == "row" else x2.t().contiguous()
    data, _, scale_inv = _quantize_matrix(m2, element, block, pow2, x.dtype)
    return QuantizedTensor(fmt=fmt or make_format(element, block, pow2), shape=shape, data=data,
                           scale=scale_inv.contiguous(), axis=axis, orig_dtype=x.dtype)


def transpose_tiles(q: QuantizedTensor) -> QuantizedTensor:
    """The other direction's copy of a 128x128-tiled quantization, without quantizing again: a square tile holds the
    same elements either way, so its amax, scale and every element's byte are the same, and the columnwise copy of
    x is the rowwise one transposed (data and scale grid; partial tiles too) - TE's 2-D weight quantizer makes its
    columnwise copy the same way. Byte for byte `quantize(x, axis="col")` from `quantize(x, axis="row")` and back
    (tests/test_fp8_block.py)."""
    if q.fmt.kind != KIND or tuple(q.fmt.block or ()) != (128, 128) or q.data.dim() != 2:
        raise FormatInputError(f"transpose_tiles: needs a 2-D 128x128 FP8 block quantization, got {q.fmt.short()}")
    return QuantizedTensor(fmt=q.fmt, shape=q.shape, data=q.data.t().contiguous(), scale=q.scale.t().contiguous(),
                           axis="col" if q.axis == "row" else "row", orig_dtype=q.orig_dtype, kernel=q.kernel)


def _decode_matrix(vals: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    r, c = vals.shape
    br, bc = block
    s = scale_inv
    if br > 1:
        s = s.repeat_interleave(br, dim=0)[:r]
    s = s.repeat_interleave(bc, dim=1)[:, :c]
    return vals * s


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ~= f32(q) * scale_inv (fp32), original shape and orientation (axis="col" is transposed back)."""
    vals = fp8_bytes_to_f32(q.data, q.fmt.element)
    out = _decode_matrix(vals, q.scale, tuple(q.fmt.block))  # type: ignore[arg-type]
    if q.axis == "col":
        out = out.t()
    return out.reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, element: str = "e4m3", block: tuple[int, int] = (1, 128), pow2: bool = True,
                  axis: str = "row",
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dequantize(quantize(x)) in x.dtype."""
    return dequantize(quantize(x, element, block, pow2, axis), torch.float32).to(out_dtype or x.dtype)
