"""The precision vocabulary shared by the language, the plan IR, the numerics and every backend.

A `TensorFormat` says how ONE operand of a GEMM (weight, activation or gradient) is stored:
element type, block shape, scale type and the scope of the second-level (global) scale.
A `Precision` bundles the three operands of a linear layer plus the backward mode.

These are pure data (pydantic, frozen, hashable): no torch import here, so `policyc plan` starts fast.
"""

from __future__ import annotations

import math
from enum import Enum
from functools import lru_cache
from typing import Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict

from .errors import PolicycError
from .format_specs import (  # noqa: F401  (re-exported vocabulary)
    ELEMENT_BITS,
    FP8_MAX,
    PER_TOKEN,
    FormatSpec,
    SPECS,
    FormatKind,
    Scope,
    is_per_token,
    kinds_where,
    matrix_dims,
    spec_of,
)

# The format vocabulary (kinds, element facts, scale scopes) and each kind's facts live in format_specs (the one
# format unit); the names below are re-exported so callers keep importing them from here.
HIGH_PRECISION_KINDS = kinds_where("high_precision")
# Kinds whose GEMMs run natively only on Blackwell (SM100); on Hopper they are emulated
# (quantize -> dequantize -> BF16/FP32 GEMM).
BLACKWELL_ONLY_KINDS = kinds_where("blackwell_only")
# FP8 per-tensor and FP8-block run natively on Hopper (SM90) and Blackwell.
HOPPER_NATIVE_KINDS = kinds_where("hopper_native")
# Kinds with a quantized backward (wgrad/dgrad GEMMs on quantized operands; TE recipes exist for these only).
QUANTIZED_BACKWARD_KINDS = kinds_where("quantized_backward")

# ---- constant tables: each fact in one place -------------------------------------------------------------------
# High-precision storage kinds: (torch / config.json dtype name, safetensors dtype name).
HP_DTYPE_NAMES = {k: s.dtype_names for k, s in SPECS.items() if s.dtype_names}
# Checkpoint dtype names (config.json `torch_dtype`, TensorInfo.dtype) -> (the high-precision format the tensor
# counts as when a policy leaves it alone, bytes per element). FP8/int8 sources count as bf16 (dequantized).
CHECKPOINT_DTYPES = {
    "bfloat16": ("bf16", 2), "bf16": ("bf16", 2), "float16": ("fp16", 2), "fp16": ("fp16", 2), "half": ("fp16", 2),
    "float32": ("fp32", 4), "fp32": ("fp32", 4), "float": ("fp32", 4),
    "float8_e4m3fn": ("bf16", 1), "float8_e5m2": ("bf16", 1), "int8": ("bf16", 1), "uint8": ("bf16", 1),
}
DEFAULT_SOURCE_DTYPE = "bfloat16"
# Checkpoint dtype of the data of a quantized SOURCE tensor, by element (TensorPlan.source_dtype of an FP8 release).
SOURCE_DTYPE_OF_FORMAT = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}

Element = Literal["bf16", "fp16", "fp32", "e4m3", "e5m2", "e2m1"]
ScaleDtype = Literal["e8m0", "e4m3", "fp32", "pow2"]
# Scope of a per-tensor-ish (second-level) scale: the values of format_specs.Scope (TENSOR, PER_TOKEN = the
# serialized "row", EXPERT, GROUP; documented there).
ScaleScope = Literal["tensor", "row", "expert", "group"]


class BackwardMode(str, Enum):
    QUANTIZED = "quantized"  # low-precision wgrad/dgrad GEMMs (fp8 / fp8_block / mxfp8 only)
    HIGH_PRECISION = "high_precision"  # backward GEMMs on the original BF16 operands
    DEQUANTIZED = "dequantized"  # backward GEMMs on BF16 dequantizations of the exact forward operands


class TensorFormat(BaseModel):
    """How one operand is stored. `block` is (rows, cols) of one scale block over the 2-D [M, K] view
    (K = the contraction / last dim); None for high-precision and per-tensor fp8."""

    model_config = ConfigDict(frozen=True)

    kind: FormatKind
    element: Element
    block: Optional[tuple[int, int]] = None
    scale_dtype: Optional[ScaleDtype] = None
    global_scale: Optional[ScaleScope] = None

    @property
    def is_quantized(self) -> bool:
        return self.kind not in HIGH_PRECISION_KINDS

    @property
    def spec(self) -> FormatSpec:
        """This format's kind's facts (format_specs: the one format unit)."""
        return SPECS[self.kind]

    @property
    def bits(self) -> float:
        """Storage bits per element, including block scales and ignoring the (negligible) per-tensor/per-row
        FP32 scales. Used for the byte accounting in `plan`."""
        return SPECS[self.kind].bits(self)

    def short(self) -> str:
        """Compact human string, e.g. `nvfp4[1x16,per_token]`, `mxfp8/e4m3[1x32]`, `bf16`."""
        return _format_short(self)


@lru_cache(maxsize=None)
def _format_short(fmt: TensorFormat) -> str:
    # Memoised: `plan` renders ~10^5 cells for DeepSeek-V3 from a handful of distinct formats.
    return SPECS[fmt.kind].short(fmt)


def hp(kind: str) -> TensorFormat:
    """High-precision format by name (bf16 | fp16 | fp32)."""
    return TensorFormat(kind=FormatKind(kind), element=kind)  # type: ignore[arg-type]


BF16 = hp("bf16")


class Precision(BaseModel):
    """What one rule assigns to one linear layer: weight, activation (GEMM input) and gradient formats,
    the backward mode, and whether it must run natively or may be emulated on this target."""

    model_config = ConfigDict(frozen=True)

    weight: TensorFormat
    activation: TensorFormat
    grad: TensorFormat
    backward: BackwardMode = BackwardMode.HIGH_PRECISION

    @property
    def is_quantized(self) -> bool:
        return self.weight.is_quantized or self.activation.is_quantized or self.grad.is_quantized

    def short(self) -> str:
        w, a, g = self.weight.short(), self.activation.short(), self.grad.short()
        if w == a == g:
            s = w
        elif not self.activation.is_quantized and not self.grad.is_quantized:
            s = f"W:{w} A:{a}"
        else:
            s = f"W:{w} A:{a} G:{g}"
        if self.is_quantized:
            s += f" bwd={self.backward.value}"
        return s

    @classmethod
    def high(cls, kind: str = "bf16") -> "Precision":
        f = hp(kind)
        return cls(weight=f, activation=f, grad=f, backward=BackwardMode.HIGH_PRECISION)


# ---- byte accounting: the one place ---------------------------------------------------------------------------
def source_bytes(dtype: str, shape: Sequence[int], fmt: Optional["TensorFormat"] = None) -> int:
    """Bytes of a checkpoint tensor of `shape` stored as `dtype` (unknown dtype names count as bf16), or, for a
    quantized source (`fmt`: an FP8-block release's E4M3 data + float32 weight_scale_inv grid), as stored in `fmt`."""
    if fmt is not None and fmt.is_quantized:
        return storage_bytes(fmt, shape)
    return math.prod(shape) * CHECKPOINT_DTYPES.get(dtype, ("bf16", 2))[1]


def storage_bytes(fmt: TensorFormat, shape: Sequence[int], *, axis: str = "row") -> int:
    """Stored bytes of a tensor of `shape` in `fmt`: data + compact block scales + FP32 second-level scales (NVFP4
    S_dec, FP8 scale_inv; one per row for a per-row scope). Partial blocks count as whole blocks. Equals the
    reference quantizer's `QuantizedTensor.nbytes` whenever it accepts the shape (formats.nbytes_of validates the
    format and answers with this; tests/test_formats_dispatch.py checks both)."""
    m, k = matrix_dims(shape)
    return SPECS[fmt.kind].nbytes(fmt, m, k, axis)


class FormatError(PolicycError, ValueError):
    """A format call in a policy is invalid. `arg` names the offending argument (if any) so the language
    layer can point the caret at it; `hint` is a one-line fix suggestion."""

    def __init__(self, message: str, hint: str = "", arg: Optional[str] = None):
        super().__init__(message)
        self.hint = hint
        self.arg = arg
