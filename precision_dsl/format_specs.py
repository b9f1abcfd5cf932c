"""THE format unit: one `FormatSpec` per `FormatKind`, everything policyc knows about a format that is not numerics.

    SPECS[kind] -> FormatSpec          spec_of(kind_or_format) -> FormatSpec

A spec owns, for its format and nowhere else:
  * the language call: its arguments (name -> allowed values, the first one the default), the positional alias,
    which operand an argument configures, an example, the default backward mode, and the operand formats the call
    means (`operands`, as `TensorFormat` field dicts: this module is below `precision.TensorFormat`);
  * element / block / scale facts and the byte accounting (`nbytes`: data + block scales + FP32 second-level
    scales, the numbers `precision.storage_bytes` answers);
  * the display (`short`, e.g. `nvfp4[1x16,per_token]`);
  * the weight an engine reads as this kind (`engine_weight`: the fields the engines fix, the rest read from the
    emitted artifacts), what every backend's `derive_formats` answers with;
  * hardware facts: runs natively on Hopper (SM90), only on Blackwell (SM100), has a quantized backward;
  * the ONE mapping TensorFormat -> reference-quantizer / kernel keyword arguments (`quantizer_kwargs`, validated;
    `precision_dsl.formats` and `precision_dsl.kernels` both dispatch through it, so they cannot drift).

The reference quantizer of a kind lives in `formats/<kind>.py` (registered by its `KIND`), its optional fused kernel
entry in `kernels/__init__.py` (a table keyed by kind); both take exactly `quantizer_kwargs`.

Second-level ("global") scale scope, `TensorFormat.global_scale`: one name per concept. The language says
`act_scale=per_token`; the IR stores the literal "row" (it is serialized into every plan and enters the plan content
hash, so the literal stays); the code spells that value `Scope.PER_TOKEN` everywhere below the IR (the reference
and kernel `scope=` argument takes the IR value unchanged, the rollout's flag is `per_token=`, SGLang's switch is
SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION). No code outside this module compares against the raw "row": "row"
in the code means the quantization direction (`axis="row"`) only.

Torch-free: `policyc plan` imports this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Optional


class FormatKind(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"  # per-tensor current scaling (TE Float8CurrentScaling), E4M3 or E5M2
    FP8_BLOCK = "fp8_block"  # DeepSeek-V3 / TE Float8BlockScaling: 1x128 activations, 128x128 weights
    MXFP8 = "mxfp8"  # OCP MX: 32-element blocks, E8M0 scales
    NVFP4 = "nvfp4"  # E2M1, E4M3 per-16 block scale, FP32 second-level scale


class Scope:
    """The IR values of `TensorFormat.global_scale` (the scope of a second-level scale), by their code names:
      TENSOR    - one scale for the whole tensor (for a routed expert weight that is one expert's tensor)
      PER_TOKEN - one FP32 scale per row of the [M, K] view = per token for activations (`act_scale=per_token`);
                  serialized as "row" (the plan hash; see the module docstring)
      EXPERT    - activations: one scale per expert GEMM input (tokens routed to that expert)
      GROUP     - weights: one scale shared by a declared share-scale group (e.g. gate+up)"""

    TENSOR = "tensor"
    PER_TOKEN = "row"
    EXPERT = "expert"
    GROUP = "group"
    ALL = ("tensor", "row", "expert", "group")


PER_TOKEN = Scope.PER_TOKEN


class FormatInputError(ValueError):
    """A tensor handed to a quantizer cannot be quantized as asked (shape not divisible by the block, wrong dtype,
    scalar input, bad `global_amax`, a format the quantizer has no layout for, ...). The message names the tensor
    dimension / argument and says what to do."""


# ---- element and scale facts: each in one place ----------------------------------------------------------------
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # largest finite float8_e4m3fn / float8_e5m2
ELEMENT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "e4m3": 8, "e5m2": 8, "e2m1": 4}
# Bits of one block scale, by scale dtype (fp32 scale_inv grids and their power-of-two variant; 1-byte E8M0 / E4M3).
SCALE_BITS = {"fp32": 32, "pow2": 32, "e8m0": 8, "e4m3": 8}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dims(text: str) -> tuple[int, int]:
    r, c = text.split("x")
    return int(r), int(c)


@dataclass(frozen=True)
class FormatSpec:
    """The facts of one format kind (see the module docstring). Subclasses override the per-format behaviour."""

    kind: FormatKind
    # the language call: argument -> allowed values (the first is the default); positional alias; arg -> operand
    args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    positional: Optional[str] = None
    arg_operand: Mapping[str, str] = field(default_factory=dict)
    example: str = ""
    default_backward: str = "high_precision"  # a precision.BackwardMode value
    # hardware / recipe facts
    high_precision: bool = False
    hopper_native: bool = False  # GEMMs run natively on Hopper (SM90) and Blackwell
    blackwell_only: bool = False  # GEMMs run natively only on Blackwell (SM100); emulated on Hopper
    quantized_backward: bool = False  # wgrad/dgrad GEMMs on quantized operands (TE recipes exist for these only)
    takes_global_amax: bool = False  # the quantizer accepts a caller-given second-level amax
    whole_blocks: bool = False  # the quantizer needs the blocked dims to divide into blocks (no partial blocks)
    # display
    short_element: bool = False  # `fp8/e4m3` rather than `fp8`
    # (torch / config.json dtype name, safetensors dtype name) of a high-precision storage kind
    dtype_names: Optional[tuple[str, str]] = None
    # why a quantized gradient / quantized backward is refused for this kind (the language's hints)
    no_grad_hint: str = ""
    no_quantized_backward_hint: str = ""

    @property
    def name(self) -> str:
        return self.kind.value

    # ---- language -----------------------------------------------------------------------------------------------
    def operands(self, args: Mapping[str, str], given: frozenset[str]) -> tuple[dict, dict, dict]:
        """(weight, activation, grad) `TensorFormat` fields of a call with validated `args` (defaults filled in);
        `given`: the argument names the call spelled out."""
        f = {"kind": self.kind, "element": self.name}
        return f, f, f

    # ---- display ------------------------------------------------------------------------------------------------
    def short_parts(self, fmt) -> list[str]:
        return [f"{fmt.block[0]}x{fmt.block[1]}"] if fmt.block else []

    def short(self, fmt) -> str:
        if self.high_precision:
            return self.name
        head = f"{self.name}/{fmt.element}" if self.short_element else self.name
        parts = self.short_parts(fmt)
        return head + (f"[{','.join(parts)}]" if parts else "")

    # ---- bytes --------------------------------------------------------------------------------------------------
    def bits(self, fmt) -> float:
        """Storage bits per element, including block scales, ignoring the per-tensor / per-row FP32 scales."""
        elem_bits = ELEMENT_BITS[fmt.element]
        if fmt.block is None:
            return float(elem_bits)
        return elem_bits + SCALE_BITS.get(fmt.scale_dtype, 8) / (fmt.block[0] * fmt.block[1])

    def block_rows(self, fmt, axis: str) -> int:
        """Rows one scale block spans over the [M, K] view quantized along `axis` (M must divide into them)."""
        return 1

    def nbytes(self, fmt, m: int, k: int, axis: str) -> int:
        """Stored bytes of an [M, K] tensor quantized along `axis`; partial blocks count as whole blocks."""
        return m * k * ELEMENT_BITS[fmt.element] // 8

    # ---- what an engine reads -----------------------------------------------------------------------------------
    def engine_weight(self, block: Optional[tuple[int, int]] = None, scale_dtype: Optional[str] = None,
                      shared: bool = False) -> dict[str, Any]:
        """`TensorFormat` fields of a weight an engine reads as this kind: the fields every engine policyc emits for
        fixes (E4M3 FP8 weights, 1x32 MXFP8, 128x128 FP8-block with fp32 scales, 1x16 NVFP4 with a per-tensor
        global scale) unless the emitted artifacts say otherwise: the `block`, the FP8-block `scale_dtype`, and
        whether an NVFP4 weight shares its global scale with the other members of its fused module (`shared`)."""
        return {"kind": self.kind, "element": self.name}

    # ---- the reference / kernel argument mapping ----------------------------------------------------------------
    def quantizer_kwargs(self, fmt, axis: str) -> dict[str, Any]:
        """The keyword arguments of `formats.<kind>.quantize` and of the kernel entry for `fmt` (validated)."""
        raise FormatInputError(f"{fmt.short()} is a high-precision format: there is nothing to quantize "
                               f"(fake_quantize is the identity for it; cast with x.to(...) if you need the dtype)")


@dataclass(frozen=True)
class _HighPrecision(FormatSpec):
    high_precision: bool = True
    hopper_native: bool = True


@dataclass(frozen=True)
class _FP8Tensor(FormatSpec):
    def operands(self, args, given):
        fwd = {"kind": self.kind, "element": "e4m3", "scale_dtype": "fp32", "global_scale": Scope.TENSOR}
        grad = dict(fwd, element="e5m2" if args["format"] == "hybrid" else "e4m3")
        return fwd, fwd, grad

    def nbytes(self, fmt, m, k, axis):
        return m * k + 4  # + the FP32 scale_inv

    def engine_weight(self, block=None, scale_dtype=None, shared=False):
        return {"kind": self.kind, "element": "e4m3"}

    def quantizer_kwargs(self, fmt, axis):
        return {"element": fmt.element, "axis": axis}


@dataclass(frozen=True)
class _FP8Block(FormatSpec):
    blocks: tuple[tuple[int, int], ...] = ((1, 128), (128, 128))

    def operands(self, args, given):
        sd = args["scales"]
        f = {"kind": self.kind, "element": "e4m3", "scale_dtype": sd}
        return dict(f, block=(128, 128)), dict(f, block=(1, 128)), dict(f, block=(1, 128))

    def short_parts(self, fmt):
        return super().short_parts(fmt) + ([fmt.scale_dtype] if fmt.scale_dtype else [])

    def block_rows(self, fmt, axis):
        return 128 if axis == "col" or tuple(fmt.block or (1, 128)) == (128, 128) else 1

    def nbytes(self, fmt, m, k, axis):
        rows, cols = (m, k) if axis == "row" else (k, m)
        br, bc = fmt.block or (1, 128)
        return m * k + 4 * _cdiv(rows, br) * _cdiv(cols, bc)

    def engine_weight(self, block=None, scale_dtype=None, shared=False):
        return {"kind": self.kind, "element": "e4m3", "block": block or (128, 128),
                "scale_dtype": scale_dtype or "fp32"}

    @staticmethod
    def pow2(fmt) -> bool:
        """Power-of-two scales: 'pow2' or unset (TE's default), not 'fp32'."""
        return fmt.scale_dtype != "fp32"

    def quantizer_kwargs(self, fmt, axis):
        if fmt.block is None or tuple(fmt.block) not in self.blocks:
            raise FormatInputError(f"{fmt.short()}: FP8 block scaling needs block (1, 128) or (128, 128), "
                                   f"got {fmt.block}")
        if fmt.scale_dtype not in (None, "pow2", "fp32"):
            raise FormatInputError(f"{fmt.short()}: FP8 block scale_dtype must be 'pow2' (TE default) or 'fp32', "
                                   f"got {fmt.scale_dtype!r}")
        return {"element": fmt.element, "block": tuple(fmt.block), "pow2": self.pow2(fmt), "axis": axis}


@dataclass(frozen=True)
class _MXFP8(FormatSpec):
    def operands(self, args, given):
        elem = args["elem"]
        grad_elem = args["grad_elem"] if "grad_elem" in given else elem  # the gradient follows elem unless given
        f = {"kind": self.kind, "scale_dtype": "e8m0"}
        return (dict(f, element=elem, block=_dims(args["weight_block"])), dict(f, element=elem, block=(1, 32)),
                dict(f, element=grad_elem, block=(1, 32)))

    def block_rows(self, fmt, axis):
        return 32 if axis == "col" or tuple(fmt.block or (1, 32)) in ((32, 32), (32, 1)) else 1

    def nbytes(self, fmt, m, k, axis):
        block = tuple(fmt.block or (1, 32))
        if block == (32, 32):
            return m * k + _cdiv(m, 32) * _cdiv(k, 32)
        col = axis == "col" or block == (32, 1)
        return m * k + (_cdiv(m, 32) * k if col else m * _cdiv(k, 32))

    def engine_weight(self, block=None, scale_dtype=None, shared=False):
        return {"kind": self.kind, "element": "e4m3", "block": block or (1, 32), "scale_dtype": "e8m0"}

    def quantizer_kwargs(self, fmt, axis):
        block = tuple(fmt.block or (1, 32))
        if block == (32, 32):
            return {"element": fmt.element, "axis": axis, "tile_2d": True}
        if block == (1, 32):
            return {"element": fmt.element, "axis": axis, "tile_2d": False}
        if block == (32, 1):
            return {"element": fmt.element, "axis": "col", "tile_2d": False}
        raise FormatInputError(f"{fmt.short()}: MXFP8 blocks are (1, 32), (32, 1) or (32, 32), got {block}")


# The language's scale names -> IR scopes, and the display of an NVFP4 scope.
_NVFP4_WEIGHT_SCALE = {"per_tensor": Scope.TENSOR, "per_expert": Scope.EXPERT}
_NVFP4_ACT_SCALE = {"per_tensor": Scope.TENSOR, "per_token": Scope.PER_TOKEN}
_SCOPE_LABEL = {Scope.PER_TOKEN: "per_token", Scope.TENSOR: "per_tensor", Scope.EXPERT: "per_expert",
                Scope.GROUP: "shared"}


@dataclass(frozen=True)
class _NVFP4(FormatSpec):
    def operands(self, args, given):
        f = {"kind": self.kind, "element": "e2m1", "scale_dtype": "e4m3"}
        weight = dict(f, block=_dims(args["weight_block"]), global_scale=_NVFP4_WEIGHT_SCALE[args["weight_scale"]])
        act = dict(f, block=(1, 16), global_scale=_NVFP4_ACT_SCALE[args["act_scale"]])
        return weight, act, {"kind": FormatKind.BF16, "element": "bf16"}  # NVFP4 recipes keep gradients in BF16

    def short_parts(self, fmt):
        return super().short_parts(fmt) + ([_SCOPE_LABEL[fmt.global_scale]] if fmt.global_scale else [])

    def block_rows(self, fmt, axis):
        return 16 if axis == "col" or tuple(fmt.block or (1, 16)) == (16, 16) else 1

    def nbytes(self, fmt, m, k, axis):
        rows, cols = (m, k) if axis == "row" else (k, m)
        tile_2d = tuple(fmt.block or (1, 16)) == (16, 16)
        data = rows * _cdiv(cols, 2)
        scales = _cdiv(rows, 16) * _cdiv(cols, 16) if tile_2d else rows * _cdiv(cols, 16)
        return data + scales + 4 * (rows if is_per_token(fmt) else 1)  # + S_dec: one per row, or one

    def engine_weight(self, block=None, scale_dtype=None, shared=False):
        return {"kind": self.kind, "element": "e2m1", "block": block or (1, 16), "scale_dtype": "e4m3",
                "global_scale": Scope.GROUP if shared else Scope.TENSOR}

    def quantizer_kwargs(self, fmt, axis):
        block = tuple(fmt.block or (1, 16))
        if block not in ((1, 16), (16, 16)):
            raise FormatInputError(f"{fmt.short()}: NVFP4 blocks are (1, 16) or (16, 16), got {block}")
        return {"axis": axis, "scope": fmt.global_scale or Scope.TENSOR, "tile_2d": block == (16, 16)}

    @staticmethod
    def one_weight_scale_per_tensor(scope: Optional[str]) -> bool:
        """Whether an NVFP4 WEIGHT global-scale scope keeps one second-level scale per weight tensor (per tensor,
        or one shared by a share-scale group): what TE keeps (one amax per weight) and what a ModelOpt checkpoint
        stores (one `weight_scale_2` per tensor). A per-expert / per-row weight scope has no such single scale."""
        return scope in (None, Scope.TENSOR, Scope.GROUP)

    @staticmethod
    def activation_scale_supported(scope: Optional[str]) -> bool:
        """Whether an NVFP4 ACTIVATION global-scale scope is one an engine computes on the fly: per tensor, or per
        token (TE's row-scaled NVFP4, FlashInfer's per-token activation)."""
        return scope in (None, Scope.TENSOR, Scope.PER_TOKEN)


def is_per_token(fmt) -> bool:
    """A format whose second-level scale is per token (one FP32 scale per row of the [M, K] view)."""
    return fmt.global_scale == Scope.PER_TOKEN


NVFP4_SPEC = _NVFP4(
    FormatKind.NVFP4,
    # NVFP4: E2M1 values, E4M3 scale per 16 values, FP32 second-level scale (per tensor, or per token for
    # activations as in Miles' per-token NVFP4); gradients stay BF16.
    args={"act_scale": ("per_tensor", "per_token"), "weight_scale": ("per_tensor", "per_expert"),
          "weight_block": ("1x16", "16x16")},
    arg_operand={"act_scale": "act", "weight_scale": "weight", "weight_block": "weight"},
    example="nvfp4(act_scale=per_token)", default_backward="high_precision", blackwell_only=True,
    takes_global_amax=True, whole_blocks=True,
    no_grad_hint="NVFP4 recipes keep gradients in bf16 (Miles/TE high-precision or dequantized backward): "
                 "drop grad=nvfp4",
    no_quantized_backward_hint="NVFP4 recipes run the backward in bf16: use backward=high_precision or "
                               "backward=dequantized")
FP8_BLOCK_SPEC = _FP8Block(
    FormatKind.FP8_BLOCK,
    # TE Float8BlockScaling defaults to power-of-2 scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 turns that off);
    # DeepSeek-V3 checkpoints store plain fp32 scale_inv.
    args={"scales": ("pow2", "fp32")}, positional="scales", example="fp8_block(scales=fp32)",
    default_backward="quantized", hopper_native=True, quantized_backward=True, short_element=True)
MXFP8_SPEC = _MXFP8(
    FormatKind.MXFP8,
    # TE MXFP8BlockScaling: 32-element E8M0 blocks; enable_2d_quantization = 32x32 forward weight blocks.
    args={"elem": ("e4m3", "e5m2"), "grad_elem": ("e4m3", "e5m2"), "weight_block": ("1x32", "32x32")},
    positional="elem", arg_operand={"weight_block": "weight", "grad_elem": "grad"}, example="mxfp8(elem=e4m3)",
    default_backward="quantized", blackwell_only=True, quantized_backward=True, short_element=True,
    whole_blocks=True)
FP8_SPEC = _FP8Tensor(
    FormatKind.FP8,
    # TE Float8CurrentScaling: HYBRID = E4M3 forward, E5M2 gradients.
    args={"format": ("e4m3", "hybrid")}, positional="format", example="fp8(hybrid)", default_backward="quantized",
    hopper_native=True, quantized_backward=True, short_element=True)

# THE registry, in FormatKind order (the language lists format names in this order).
SPECS: dict[FormatKind, FormatSpec] = {
    FormatKind.BF16: _HighPrecision(FormatKind.BF16, example="bf16", dtype_names=("bfloat16", "BF16")),
    FormatKind.FP16: _HighPrecision(FormatKind.FP16, example="fp16", dtype_names=("float16", "F16")),
    FormatKind.FP32: _HighPrecision(FormatKind.FP32, example="fp32", dtype_names=("float32", "F32")),
    FormatKind.FP8: FP8_SPEC,
    FormatKind.FP8_BLOCK: FP8_BLOCK_SPEC,
    FormatKind.MXFP8: MXFP8_SPEC,
    FormatKind.NVFP4: NVFP4_SPEC,
}
assert list(SPECS) == list(FormatKind), "one spec per FormatKind, in FormatKind order"


def spec_of(kind_or_fmt) -> FormatSpec:
    """The spec of a FormatKind, a kind name ("nvfp4") or a TensorFormat."""
    kind = getattr(kind_or_fmt, "kind", kind_or_fmt)
    return SPECS[kind]  # a str-valued enum: "nvfp4" finds FormatKind.NVFP4


def kinds_where(fact: str) -> frozenset[FormatKind]:
    """The kinds whose spec has boolean `fact` set (e.g. "blackwell_only")."""
    return frozenset(k for k, s in SPECS.items() if getattr(s, fact))


def matrix_dims(shape) -> tuple[int, int]:
    """(M, K) of the 2-D [M, K] view of `shape` (M = prod(shape[:-1]); a 0-dim shape counts as [1, 1])."""
    shape = tuple(int(s) for s in shape)
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
