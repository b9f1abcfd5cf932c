"""Bit-exact reference quantizers, dispatched on a plan `TensorFormat` (see base.py for the contract).

    quantize(x, fmt, *, axis="row", global_amax=None) -> QuantizedTensor
    dequantize(q, dtype=torch.float32) -> Tensor
    fake_quantize(x, fmt, *, axis="row", global_amax=None, out_dtype=None) -> Tensor   # identity for bf16/fp16/fp32
    nbytes_of(fmt, shape, *, axis="row") -> int                                      # == quantize(x).nbytes
    group_amax(tensors) -> fp32 [1]                       # shared G of an NVFP4 share-scale group
    emulated_linear(x, weight_q, act_fmt, bias=None, out_dtype=None)   # gemm.py: quant->dequant GEMM emulation

Format -> reference module (each module's docstring is the executable spec of its rounding and edge cases):
    FP8       (per-tensor current scaling)  -> fp8_tensor   element e4m3|e5m2
    FP8_BLOCK (TE Float8BlockScaling)       -> fp8_block    block (1,128)|(128,128), scale_dtype pow2 (default)|fp32
    MXFP8                                   -> mxfp8        block (1,32) (axis row/col) | (32,1) (= col) | (32,32) 2D
    NVFP4                                   -> nvfp4        block (1,16)|(16,16), global_scale tensor|row|expert|group

This package imports torch at import time; nothing else in precision_dsl may import it at module import time
(import it lazily inside functions).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..precision import HIGH_PRECISION_KINDS, HP_DTYPE_NAMES, FormatKind, TensorFormat, storage_bytes
from . import fp8_block, fp8_tensor, mxfp8, nvfp4, swizzle
from .base import FormatInputError, QuantizedTensor
from .gemm import emulated_linear
from .nvfp4 import group_amax

__all__ = [
    "FormatInputError", "QuantizedTensor", "quantize", "dequantize", "fake_quantize", "nbytes_of", "group_amax",
    "emulated_linear", "torch_dtype", "mxfp8", "nvfp4", "fp8_block", "fp8_tensor", "swizzle",
]


def torch_dtype(fmt: TensorFormat) -> torch.dtype:
    """The torch dtype of a high-precision storage format (bf16 / fp16 / fp32)."""
    return getattr(torch, HP_DTYPE_NAMES[fmt.kind][0])


# The TensorFormat -> reference-arguments mapping, with its validation. Public because every dispatcher over the
# references (here, and the kernels' entry point) must use this one mapping, so that they cannot drift.
def mxfp8_layout(fmt: TensorFormat, axis: str) -> tuple[str, bool]:
    block = tuple(fmt.block or (1, 32))
    if block == (32, 32):
        return axis, True
    if block == (1, 32):
        return axis, False
    if block == (32, 1):
        return "col", False
    raise FormatInputError(f"{fmt.short()}: MXFP8 blocks are (1, 32), (32, 1) or (32, 32), got {block}")


def fp8_block_pow2(fmt: TensorFormat) -> bool:
    """Power-of-two scales for an fp8_block format: 'pow2' or unset (TE's default), not 'fp32'."""
    return fmt.scale_dtype != "fp32"


def fp8_block_args(fmt: TensorFormat) -> tuple[tuple[int, int], bool]:
    if fmt.block is None or tuple(fmt.block) not in fp8_block.BLOCKS:
        raise FormatInputError(f"{fmt.short()}: FP8 block scaling needs block (1, 128) or (128, 128), got {fmt.block}")
    if fmt.scale_dtype not in (None, "pow2", "fp32"):
        raise FormatInputError(f"{fmt.short()}: FP8 block scale_dtype must be 'pow2' (TE default) or 'fp32', "
                               f"got {fmt.scale_dtype!r}")
    return tuple(fmt.block), fp8_block_pow2(fmt)  # type: ignore[return-value]


def nvfp4_args(fmt: TensorFormat) -> tuple[bool, str]:
    block = tuple(fmt.block or (1, 16))
    if block not in ((1, 16), (16, 16)):
        raise FormatInputError(f"{fmt.short()}: NVFP4 blocks are (1, 16) or (16, 16), got {block}")
    return block == (16, 16), fmt.global_scale or "tensor"


def check_format(fmt: TensorFormat, global_amax) -> None:
    if not isinstance(fmt, TensorFormat):
        raise FormatInputError(f"expected a precision.TensorFormat, got {type(fmt).__name__}")
    if global_amax is not None and fmt.kind != FormatKind.NVFP4:
        raise FormatInputError(f"{fmt.short()}: global_amax only applies to NVFP4 (second-level scale)")


def quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row",
             global_amax: Optional[torch.Tensor | float] = None) -> QuantizedTensor:
    """Quantize `x` to `fmt` bit-exactly (TE semantics). Raises FormatInputError for high-precision formats,
    unsupported block shapes and bad inputs (see the format modules for shape / dtype rules)."""
    check_format(fmt, global_amax)
    kind = fmt.kind
    if kind in HIGH_PRECISION_KINDS:
        raise FormatInputError(f"{fmt.short()} is a high-precision format: there is nothing to quantize "
                               f"(fake_quantize is the identity for it; cast with x.to(...) if you need the dtype)")
    if kind == FormatKind.FP8:
        return fp8_tensor.quantize(x, fmt.element, axis, fmt=fmt)
    if kind == FormatKind.FP8_BLOCK:
        block, pow2 = fp8_block_args(fmt)
        return fp8_block.quantize(x, fmt.element, block, pow2, axis, fmt=fmt)
    if kind == FormatKind.MXFP8:
        ax, tile_2d = mxfp8_layout(fmt, axis)
        return mxfp8.quantize(x, fmt.element, ax, tile_2d, fmt=fmt)
    if kind == FormatKind.NVFP4:
        tile_2d, scope = nvfp4_args(fmt)
        return nvfp4.quantize(x, axis, scope, tile_2d, global_amax, fmt=fmt)
    raise FormatInputError(f"no reference quantizer for format kind {kind!r}")


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a QuantizedTensor to `dtype` in its original shape (columnwise copies are transposed back)."""
    kind = q.fmt.kind
    if kind == FormatKind.FP8:
        return fp8_tensor.dequantize(q, dtype)
    if kind == FormatKind.FP8_BLOCK:
        return fp8_block.dequantize(q, dtype)
    if kind == FormatKind.MXFP8:
        return mxfp8.dequantize(q, dtype)
    if kind == FormatKind.NVFP4:
        return nvfp4.dequantize(q, dtype)
    raise FormatInputError(f"cannot dequantize a tensor of format {q.fmt.short()}")


def fake_quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row",
                  global_amax: Optional[torch.Tensor | float] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dequantize(quantize(x, fmt)) returned in `out_dtype` (default x.dtype); identity for bf16/fp16/fp32 formats.
    Bitwise equal to the two-step path (the fp32 dequantized values are the same; tested)."""
    check_format(fmt, global_amax)
    out_dtype = out_dtype or x.dtype
    kind = fmt.kind
    if kind in HIGH_PRECISION_KINDS:
        return x if x.dtype == out_dtype else x.to(out_dtype)
    if kind == FormatKind.MXFP8:
        ax, tile_2d = mxfp8_layout(fmt, axis)
        return mxfp8.fake_quantize(x, fmt.element, ax, tile_2d, out_dtype=out_dtype)
    if kind == FormatKind.NVFP4:
        tile_2d, scope = nvfp4_args(fmt)
        return nvfp4.fake_quantize(x, axis, scope, tile_2d, global_amax, out_dtype=out_dtype)
    return dequantize(quantize(x, fmt, axis=axis), torch.float32).to(out_dtype)


def nbytes_of(fmt: TensorFormat, shape: Sequence[int], *, axis: str = "row") -> int:
    """Storage bytes of a tensor of `shape` in `fmt` (precision.storage_bytes, the one byte accounting), after
    validating the format the way `quantize` does. Equals `quantize(x, fmt, axis=axis).nbytes` whenever quantize
    accepts the shape (partial blocks are counted as whole blocks otherwise)."""
    if len(tuple(shape)) == 0:
        raise FormatInputError("nbytes_of: shape must have at least one dim")
    kind = fmt.kind
    if kind == FormatKind.FP8_BLOCK:
        fp8_block_args(fmt)
    elif kind == FormatKind.MXFP8:
        mxfp8_layout(fmt, axis)
    elif kind == FormatKind.NVFP4:
        nvfp4_args(fmt)
    elif kind not in HIGH_PRECISION_KINDS and kind != FormatKind.FP8:
        raise FormatInputError(f"nbytes_of: unknown format kind {kind!r}")
    return storage_bytes(fmt, shape, axis=axis)
