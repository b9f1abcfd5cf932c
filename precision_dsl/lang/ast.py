"""AST of the policy language. Produced by `lang.parser`, consumed by `resolve` (a pure function).

Every node carries a `Span` (file, line, col, end_line, end_col) so that any semantic error can be reported as
`file:line:col` with the offending line and a caret, like a syntax error.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from ..diagnostics import Span  # the source location every diagnostic points at; nodes carry one


class Node(BaseModel):
    model_config = ConfigDict(frozen=True)

    span: Span


# ---- selectors ---------------------------------------------------------------------------------------------------
class LayerBound(Node):
    """One bound or index of a layer slice: an integer (may be negative) or a percentage (may be negative)."""

    value: float
    percent: bool = False


class LayerSlice(Node):
    """`layers[...]`. Either a list of single indices (`layers[0, 3, -1]`) or one range (`layers[a:b]`,
    either bound optional). Percent bounds follow the documented rounding rule (see resolve.layer_indices)."""

    indices: tuple[LayerBound, ...] = ()
    start: Optional[LayerBound] = None
    stop: Optional[LayerBound] = None
    is_range: bool = False


class RoleSelector(Node):
    """`routed_experts`, `routed_experts.gate`, `routed_experts.{gate, up}`, `attn.kv_b`, `mtp`, `norm` ..."""

    group: str
    members: tuple[str, ...] = ()  # empty = the whole group


class NameGlob(Node):
    """Raw-name escape hatch: `name("model.layers.*.mlp.gate.weight")` - fnmatch on HF tensor names."""

    pattern: str


class Selector(Node):
    """A conjunction: optional layer slice AND optional role selector AND optional name glob.
    `layers[-15%:]` alone selects every tensor in those layers; `layers[0:3].attn` narrows by role."""

    layers: Optional[LayerSlice] = None
    role: Optional[RoleSelector] = None
    name: Optional[NameGlob] = None
    # `mtp` / `mtp.<role>`: restrict to the MTP modules (TensorInfo.mtp is not None). Role selectors without this
    # prefix match decoder/top-level tensors only (added by the language part; additive).
    mtp: bool = False


# ---- formats -----------------------------------------------------------------------------------------------------
class FormatArg(Node):
    key: str
    value: Union[str, int, float]


class FormatCall(Node):
    """`nvfp4(act_scale=per_token, weight_scale=per_tensor)`, `bf16`, `mxfp8(e4m3)` (positional -> key "_0")."""

    name: str
    args: tuple[FormatArg, ...] = ()


class PrecisionSpec(Node):
    """Right-hand side of a rule. Either a single `base` format for all operands, or per-operand
    `weight=` / `act=` / `grad=` overrides (which may be combined with a base), plus `backward=`."""

    base: Optional[FormatCall] = None
    weight: Optional[FormatCall] = None
    act: Optional[FormatCall] = None
    grad: Optional[FormatCall] = None
    backward: Optional[str] = None
    backward_span: Optional[Span] = None


# ---- statements --------------------------------------------------------------------------------------------------
class Rule(Node):
    selector: Selector
    precision: PrecisionSpec
    optional: bool = False
    text: str  # the rule's source text, for explain/plan provenance


class ShareScale(Node):
    selector: Selector
    optional: bool = False
    text: str


class Target(Node):
    hardware: Literal["hopper", "blackwell"]
    emulate: bool = False  # `target hopper emulate`: allow Blackwell-only formats by exact emulation


class Default(Node):
    precision: PrecisionSpec


class Import(Node):
    path: str  # as written; resolved relative to the importing file, then the bundled policies dir
    kind: Literal["import", "extends"] = "import"


Statement = Union[Rule, ShareScale, Target, Default, Import]


class Policy(Node):
    name: str
    statements: tuple[Statement, ...]
    source: str  # full text of the file (for caret diagnostics)
