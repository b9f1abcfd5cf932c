"""The precision vocabulary shared by the language, the plan IR, the numerics and every backend.

A `TensorFormat` says how ONE operand of a GEMM (weight, activation or gradient) is stored:
element type, block shape, scale type and the scope of the second-level (global) scale.
A `Precision` bundles the three operands of a linear layer plus the backward mode.

These are pure data (pydantic, frozen, hashable): no torch import here, so `policyc plan` starts fast.
"""

from __future__ import annotations

from enum import Enum
from functools import lru_cache
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict


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
        elem_bits = {"fp32": 32, "bf16": 16, "fp16": 16, "e4m3": 8, "e5m2": 8, "e2m1": 4}[self.element]
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


class FormatError(ValueError):
    """A format call in a policy is invalid. `arg` names the offending argument (if any) so the language
    layer can point the caret at it; `hint` is a one-line fix suggestion."""

    def __init__(self, message: str, hint: str = "", arg: Optional[str] = None):
        super().__init__(message)
        self.hint = hint
        self.arg = arg
