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
    NVFP4                                   -> nvfp4        block (1,16)|(16,16), global_scale tensor|row (Scope.PER_TOKEN)|expert|group

This package imports torch at import time; nothing else in precision_dsl may import it at module import time
(import it lazily inside functions).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..format_specs import FP8_BLOCK_SPEC, FormatInputError, spec_of
from ..precision import HP_DTYPE_NAMES, TensorFormat, storage_bytes
from . import fp8_block, fp8_tensor, mxfp8, nvfp4, swizzle
from .base import QuantizedTensor
from .gemm import emulated_linear
from .nvfp4 import group_amax

__all__ = [
    "FormatInputError", "QuantizedTensor", "quantize", "dequantize", "fake_quantize", "nbytes_of", "group_amax",
    "emulated_linear", "torch_dtype", "mxfp8", "nvfp4", "fp8_block", "fp8_tensor", "swizzle", "REFERENCES",
    "reference_for", "quantizer_kwargs",
]

# The reference module of each quantized kind, registered by the module's own KIND (each takes the spec's
# `quantizer_kwargs` in its quantize / fake_quantize, and has dequantize(q, dtype)).
REFERENCES = {m.KIND: m for m in (fp8_tensor, fp8_block, mxfp8, nvfp4)}


def torch_dtype(fmt: TensorFormat) -> torch.dtype:
    """The torch dtype of a high-precision storage format (bf16 / fp16 / fp32)."""
    return getattr(torch, HP_DTYPE_NAMES[fmt.kind][0])


def check_format(fmt: TensorFormat, global_amax) -> None:
    if not isinstance(fmt, TensorFormat):
        raise FormatInputError(f"expected a precision.TensorFormat, got {type(fmt).__name__}")
    if global_amax is not None and not fmt.spec.takes_global_amax:
        raise FormatInputError(f"{fmt.short()}: global_amax only applies to NVFP4 (second-level scale)")


def quantizer_kwargs(fmt: TensorFormat, axis: str, global_amax=None) -> dict:
    """THE TensorFormat -> reference-arguments mapping (format_specs: `FormatSpec.quantizer_kwargs`), validated,
    plus `global_amax` for the kinds that take one. Every dispatcher over the references (here, and the kernels'
    entry point) uses it, so that they cannot drift."""
    check_format(fmt, global_amax)
    kw = fmt.spec.quantizer_kwargs(fmt, axis)
    if fmt.spec.takes_global_amax:
        kw["global_amax"] = global_amax
    return kw


def reference_for(fmt: TensorFormat):
    """The reference module of a quantized format."""
    try:
        return REFERENCES[fmt.kind]
    except KeyError:
        raise FormatInputError(f"no reference quantizer for format {fmt.short()}") from None


# Power-of-two scales for an fp8_block format (the spec's fact; public: the engine's fast paths read it too).
fp8_block_pow2 = FP8_BLOCK_SPEC.pow2


def quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row",
             global_amax: Optional[torch.Tensor | float] = None) -> QuantizedTensor:
    """Quantize `x` to `fmt` bit-exactly (TE semantics). Raises FormatInputError for high-precision formats,
    unsupported block shapes and bad inputs (see the format modules for shape / dtype rules)."""
    kw = quantizer_kwargs(fmt, axis, global_amax)
    return reference_for(fmt).quantize(x, **kw, fmt=fmt)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a QuantizedTensor to `dtype` in its original shape (columnwise copies are transposed back)."""
    if q.fmt.kind not in REFERENCES:
        raise FormatInputError(f"cannot dequantize a tensor of format {q.fmt.short()}")
    return REFERENCES[q.fmt.kind].dequantize(q, dtype)


def fake_quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row",
                  global_amax: Optional[torch.Tensor | float] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dequantize(quantize(x, fmt)) returned in `out_dtype` (default x.dtype); identity for bf16/fp16/fp32 formats.
    Bitwise equal to the two-step path (the fp32 dequantized values are the same; tested)."""
    check_format(fmt, global_amax)
    out_dtype = out_dtype or x.dtype
    if not fmt.is_quantized:
        return x if x.dtype == out_dtype else x.to(out_dtype)
    kw = quantizer_kwargs(fmt, axis, global_amax)
    return reference_for(fmt).fake_quantize(x, **kw, out_dtype=out_dtype)


def nbytes_of(fmt: TensorFormat, shape: Sequence[int], *, axis: str = "row") -> int:
    """Storage bytes of a tensor of `shape` in `fmt` (precision.storage_bytes, the one byte accounting), after
    validating the format the way `quantize` does. Equals `quantize(x, fmt, axis=axis).nbytes` whenever quantize
    accepts the shape (partial blocks are counted as whole blocks otherwise)."""
    if len(tuple(shape)) == 0:
        raise FormatInputError("nbytes_of: shape must have at least one dim")
    if fmt.is_quantized:
        spec_of(fmt).quantizer_kwargs(fmt, axis)
    return storage_bytes(fmt, shape, axis=axis)
