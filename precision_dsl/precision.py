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


class FormatKind(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"  # per-tensor current scaling (TE Float8CurrentScaling), E4M3 or E5M2
    FP8_BLOCK = "fp8_block"  # DeepSeek-V3 / TE Float8BlockScaling: 1x128 activations, 128x128 weights
    MXFP8 = "mxfp8"  # OCP MX: 32-element blocks, E8M0 scales
    NVFP4 = "nvfp4"  # E2M1, E4M3 per-16 block scale, FP32 second-level scale


HIGH_PRECISION_KINDS = frozenset({FormatKind.BF16, FormatKind.FP16, FormatKind.FP32})
# Kinds whose GEMMs run natively only on Blackwell (SM100); on Hopper they are emulated
# (quantize -> dequantize -> BF16/FP32 GEMM). See ../shared/research/quantizers.md section 7.
BLACKWELL_ONLY_KINDS = frozenset({FormatKind.MXFP8, FormatKind.NVFP4})
# FP8 per-tensor and FP8-block run natively on Hopper (SM90) and Blackwell.
HOPPER_NATIVE_KINDS = frozenset({FormatKind.FP8, FormatKind.FP8_BLOCK}) | HIGH_PRECISION_KINDS

# Kinds with a quantized backward (wgrad/dgrad GEMMs on quantized operands; TE recipes exist for these only).
QUANTIZED_BACKWARD_KINDS = frozenset({FormatKind.FP8, FormatKind.FP8_BLOCK, FormatKind.MXFP8})

# ---- constant tables: each fact in one place -------------------------------------------------------------------
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # largest finite float8_e4m3fn / float8_e5m2
ELEMENT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "e4m3": 8, "e5m2": 8, "e2m1": 4}
# High-precision storage kinds: (torch / config.json dtype name, safetensors dtype name).
HP_DTYPE_NAMES = {FormatKind.BF16: ("bfloat16", "BF16"), FormatKind.FP16: ("float16", "F16"),
                  FormatKind.FP32: ("float32", "F32")}
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
# Scope of a per-tensor-ish (second-level) scale:
#   tensor  - one scale for the whole tensor (for a routed expert weight that is one expert's tensor)
#   row     - one FP32 scale per row = per token for activations ("per_token" in the language)
#   expert  - activations: one scale per expert GEMM input (tokens routed to that expert)
#   group   - weights: one scale shared by a declared share-scale group (e.g. gate+up)
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
    def bits(self) -> float:
        """Storage bits per element, including block scales and ignoring the (negligible) per-tensor/per-row
        FP32 scales. Used for the byte accounting in `plan`."""
        elem_bits = ELEMENT_BITS[self.element]
        if self.block is None:
            return float(elem_bits)
        scale_bits = 32 if self.scale_dtype in ("fp32", "pow2") else 8
        return elem_bits + scale_bits / (self.block[0] * self.block[1])

    def short(self) -> str:
        """Compact human string, e.g. `nvfp4[1x16,per_token]`, `mxfp8/e4m3[1x32]`, `bf16`."""
        return _format_short(self)

    def _short(self) -> str:
        if not self.is_quantized:
            return self.kind.value
        parts = []
        if self.block:
            parts.append(f"{self.block[0]}x{self.block[1]}")
        if self.kind in (FormatKind.FP8, FormatKind.FP8_BLOCK, FormatKind.MXFP8):
            head = f"{self.kind.value}/{self.element}"
        else:
            head = self.kind.value
        if self.kind == FormatKind.FP8_BLOCK and self.scale_dtype:
            parts.append(self.scale_dtype)
        if self.global_scale and self.kind in (FormatKind.NVFP4,):
            parts.append({"row": "per_token", "tensor": "per_tensor", "expert": "per_expert", "group": "shared"}[
                self.global_scale])
        return head + (f"[{','.join(parts)}]" if parts else "")


@lru_cache(maxsize=None)
def _format_short(fmt: TensorFormat) -> str:
    # Memoised: `plan` renders ~10^5 cells for DeepSeek-V3 from a handful of distinct formats.
    return fmt._short()


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
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    shape = tuple(int(s) for s in shape)
    m, k = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    kind = fmt.kind
    if kind in HIGH_PRECISION_KINDS:
        return m * k * ELEMENT_BITS[fmt.element] // 8
    if kind == FormatKind.FP8:
        return m * k + 4
    rows, cols = (m, k) if axis == "row" else (k, m)
    if kind == FormatKind.FP8_BLOCK:
        br, bc = fmt.block or (1, 128)
        return m * k + 4 * _cdiv(rows, br) * _cdiv(cols, bc)
    if kind == FormatKind.MXFP8:
        block = tuple(fmt.block or (1, 32))
        if block == (32, 32):
            return m * k + _cdiv(m, 32) * _cdiv(k, 32)
        col = axis == "col" or block == (32, 1)
        return m * k + (_cdiv(m, 32) * k if col else m * _cdiv(k, 32))
    if kind == FormatKind.NVFP4:
        tile_2d = tuple(fmt.block or (1, 16)) == (16, 16)
        data = rows * _cdiv(cols, 2)
        scales = _cdiv(rows, 16) * _cdiv(cols, 16) if tile_2d else rows * _cdiv(cols, 16)
        return data + scales + 4 * (rows if fmt.global_scale == "row" else 1)
    raise ValueError(f"storage_bytes: unknown format kind {kind!r}")


class FormatError(PolicycError, ValueError):
    """A format call in a policy is invalid. `arg` names the offending argument (if any) so the language
    layer can point the caret at it; `hint` is a one-line fix suggestion."""

    def __init__(self, message: str, hint: str = "", arg: Optional[str] = None):
        super().__init__(message)
        self.hint = hint
        self.arg = arg
