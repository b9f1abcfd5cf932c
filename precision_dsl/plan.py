"""The plan: the per-tensor precision IR that every backend consumes.

One `TensorPlan` per checkpoint tensor, in HF order. A plan is a pure function of (policy files, architecture,
parallel layout); its `content_hash` covers only what changes bytes or kernels (formats, groups, names, shapes),
not where rules came from, so moving a policy file does not change the contract.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from enum import Enum
from functools import lru_cache
from typing import Any, Callable, Hashable, Iterator, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from . import __version__
from .arch.base import CheckpointTensor, unvalidated_constructor
from .precision import CHECKPOINT_DTYPES, DEFAULT_SOURCE_DTYPE, BackwardMode, Precision, TensorFormat, hp


@lru_cache(maxsize=None)
def _hp_of_dtype(dtype: str) -> TensorFormat:
    return hp(CHECKPOINT_DTYPES.get(dtype, ("bf16", 2))[0])


class RuleRef(BaseModel):
    """Where a rule came from: file:line:col and the rule's source text."""

    model_config = ConfigDict(frozen=True)

    file: str
    line: int
    col: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class ParallelSide(BaseModel):
    """One side's parallel layout (trainer = Megatron, rollout = SGLang)."""

    model_config = ConfigDict(frozen=True)

    tp: int = 1
    etp: int = 1  # expert tensor parallel (SGLang: moe_tp_size = tp // ep // moe_dp)
    ep: int = 1
    pp: int = 1


class ParallelLayout(BaseModel):
    model_config = ConfigDict(frozen=True)

    trainer: ParallelSide = ParallelSide()
    rollout: ParallelSide = ParallelSide()


class TensorPlan(CheckpointTensor, BaseModel):
    model_config = ConfigDict(frozen=True)

    hf_name: str
    megatron_name: Optional[str] = None
    megatron_part: Optional[str] = None
    sglang_prefix: Optional[str] = None  # shared-expert fusion off (it depends on the launch: sglang.serving_prefix)
    role: str
    layer: Optional[int] = None
    expert: Optional[int] = None
    mtp: Optional[int] = None
    shape: tuple[int, ...]
    is_linear: bool
    # For linear weights: the full precision. For other tensors (norms, embeddings, router, biases) only
    # `precision.weight` is meaningful and it is always high precision.
    precision: Precision
    share_scale_group: Optional[str] = None  # id of the share-scale group (all members use one global scale)
    bytes_before: int  # in the checkpoint dtype (precision.source_bytes)
    bytes_after: int  # weight storage under the plan: data + block scales (precision.storage_bytes)
    decided_by: Optional[RuleRef] = None  # None: the policy's `default`
    overridden: tuple[RuleRef, ...] = ()  # earlier matching rules this one overrode, in source order
    # Carried from the architecture so that no consumer re-derives them. Both are facts of the model, not of the
    # policy, and are left out of content_hash (names and shapes already pin the model).
    fused_group: Optional[str] = None  # FUSED_SIBLINGS key (TensorInfo.fused_group): engines run these as one GEMM
    source_dtype: str = DEFAULT_SOURCE_DTYPE  # dtype of the source checkpoint tensor (precision.CHECKPOINT_DTYPES)
    # What a dtype cannot say for a quantized source: its storage format. For the linears of an FP8-block release
    # (DeepSeek-V3, Kimi-K2: config.json quantization_config, arch/source.py) source_dtype is float8_e4m3fn and this
    # is fp8_block/e4m3 with the release's block and scale kind (a `<module>.weight_scale_inv` grid); None for
    # tensors stored plainly in source_dtype. The converter holds the checkpoint's headers to it, dequantizes or
    # passes through (backends/fp8_source.py).
    source_format: Optional[TensorFormat] = None

    @property
    def source_precision(self) -> TensorFormat:
        """How the source stores this tensor, as a format: `source_format`, or the high-precision `source_dtype`."""
        if self.source_format is not None:
            return self.source_format
        return _hp_of_dtype(self.source_dtype)

    @property
    def weight(self) -> TensorFormat:
        return self.precision.weight

    @property
    def activation(self) -> TensorFormat:
        return self.precision.activation

    @property
    def grad(self) -> TensorFormat:
        return self.precision.grad

    @property
    def backward(self) -> BackwardMode:
        return self.precision.backward


# The resolver builds one TensorPlan per checkpoint tensor (46k on DeepSeek-V3) from values that are valid by
# construction: without per-object validation (arch.base.unvalidated_constructor, same objects as model_construct).
new_tensor_plan = unvalidated_constructor(TensorPlan, dict(
    hf_name="model.layers.0.mlp.experts.1.gate_proj.weight", megatron_name="m", megatron_part="gate",
    sglang_prefix="s", role="routed_experts.gate", layer=0, expert=1, mtp=None, shape=(4, 2), is_linear=True,
    precision=Precision.high(), share_scale_group=None, bytes_before=16, bytes_after=16, decided_by=None,
    overridden=(), fused_group="experts.gate_up", source_dtype=DEFAULT_SOURCE_DTYPE, source_format=None))


class ShareScaleGroup(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str  # e.g. model.layers.3.mlp.experts.17.{gate_proj,up_proj}
    members: tuple[str, ...]  # HF tensor names
    declared_at: Optional[RuleRef] = None


new_share_scale_group = unvalidated_constructor(ShareScaleGroup, dict(
    id="model.layers.0.mlp.experts.1.{gate_proj,up_proj}", members=("a", "b"), declared_at=None))


_T = TypeVar("_T")


class _Memo:
    """Values derived from one plan instance (its content hash, a backend's validated config), kept on the instance.
    It is not part of the plan: every _Memo compares equal (so a plan that has computed its hash equals one that has
    not), and a copy or a pickle starts empty (a `model_copy(update=...)` is another plan)."""

    __slots__ = ("values",)

    def __init__(self):
        self.values: dict[str, Any] = {}

    def __eq__(self, other) -> bool:
        return isinstance(other, _Memo)

    __hash__ = None  # type: ignore[assignment]

    def __copy__(self) -> "_Memo":
        return _Memo()

    def __deepcopy__(self, memo) -> "_Memo":
        return _Memo()

    def __reduce__(self):
        return (_Memo, ())


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)
    _memo: _Memo = PrivateAttr(default_factory=_Memo)

    policy_name: str
    policy_files: tuple[str, ...]  # the root file first, then imports in resolution order
    model: str  # architecture name
    model_type: str
    num_layers: int
    target: str  # hopper | blackwell
    emulate: bool = False  # formats not native on `target` are run by exact emulation
    parallel: Optional[ParallelLayout] = None
    tensors: tuple[TensorPlan, ...]
    share_scale_groups: tuple[ShareScaleGroup, ...] = ()
    policyc_version: str = __version__
    notes: tuple[str, ...] = Field(default=())

    # -- derived values, cached on the instance ----------------------------------------------------------------
    def memo(self, key: str, compute: Callable[[], _T]) -> _T:
        """`compute()` once per plan instance and `key`: for pure functions of this (frozen) plan that several
        consumers ask for (the content hash that every artifact stamps, a backend's validated config that check,
        emit and the Miles launch all need). The cache lives and dies with the instance."""
        priv = self.__pydantic_private__
        memo = priv.get("_memo") if priv is not None else None
        if not isinstance(memo, _Memo):  # built without pydantic's private-attribute init
            memo = _Memo()
            if priv is None:
                object.__setattr__(self, "__pydantic_private__", {"_memo": memo})
            else:
                priv["_memo"] = memo
        values = memo.values
        if key not in values:
            values[key] = compute()
        return values[key]

    def __copy__(self):
        # model_copy(update=...) is a shallow copy plus new field values: the copy must not inherit the cache
        copied = super().__copy__()
        if copied.__pydantic_private__ is not None:
            copied.__pydantic_private__["_memo"] = _Memo()
        return copied

    # -- contract ------------------------------------------------------------------------------------------------
    def content_hash(self) -> str:
        """sha256 over the byte-relevant contract: target, formats, backward modes, groups, names, shapes. Computed
        once per plan instance (it walks every tensor: 46k on DeepSeek-V3, and every artifact stamps it)."""
        return self.memo("content_hash", self._content_hash)

    def _content_hash(self) -> str:
        # One line per tensor; the precision JSON is cached per Precision *object* (a plan shares a handful of them
        # across thousands of tensors; keying by value would hash the nested pydantic models 46k times, ~0.5 s on
        # DeepSeek-V3). The ids stay valid: the plan holds every Precision for the duration.
        h = hashlib.sha256(json.dumps({"target": self.target}, sort_keys=True).encode())
        _update_joined(h, self._contract_lines())
        return "sha256:" + h.hexdigest()

    def _contract_lines(self) -> Iterator[str]:
        """One line per tensor, then one per share-scale group: what content_hash covers."""
        dumped: dict[int, str] = {}
        shapes: dict[int, str] = {}  # shape tuples are shared by the tensors of one shape (arch/_emit.py)
        for t in self.tensors:
            d = t.__dict__
            prec, shape = d["precision"], d["shape"]
            p = dumped.get(id(prec))
            if p is None:
                p = dumped[id(prec)] = json.dumps(prec.model_dump(mode="json"), sort_keys=True,
                                                  separators=(",", ":"))
            dims = shapes.get(id(shape))
            if dims is None:
                dims = shapes[id(shape)] = ",".join(map(str, shape))
            yield (f"T|{d['hf_name']}|{d['megatron_name']}|{d['megatron_part']}|{d['sglang_prefix']}|{dims}|{p}|"
                   f"{d['share_scale_group']}")
        for g in self.share_scale_groups:
            yield f"G|{g.id}|{','.join(g.members)}"

    # -- convenience lookups -------------------------------------------------------------------------------------
    def by_name(self) -> dict[str, TensorPlan]:
        return {t.hf_name: t for t in self.tensors}

    def group_of(self, hf_name: str) -> Optional[ShareScaleGroup]:
        for g in self.share_scale_groups:
            if hf_name in g.members:
                return g
        return None

    def fused_members(self) -> dict[tuple, list[TensorPlan]]:
        """Fused-sibling instances -> their tensors, in plan order."""
        out: dict[tuple, list[TensorPlan]] = {}
        for t in self.tensors:
            key = t.fused_key
            if key is not None:
                out.setdefault(key, []).append(t)
        return out

    def quantized(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.is_linear and t.weight.is_quantized]

    def to_json(self, indent: Optional[int] = None, content_hash: Optional[str] = None) -> str:
        """JSON with the content hash as the first key (`content_hash`: a hash the caller already computed for this
        plan). Compact by default: byte for byte what pydantic's `model_dump_json` writes (tests/test_commands.py),
        see `json_pieces`; `indent` pretty-prints through the json module (slower)."""
        if indent is not None:
            d = {"content_hash": content_hash or self.content_hash(), **self.model_dump(mode="json")}
            return json.dumps(d, indent=indent)
        return "".join(self.json_pieces(content_hash))

    def json_pieces(self, content_hash: Optional[str] = None) -> Iterator[str]:
        """The compact `to_json` text in consecutive pieces of about a thousand tensors each, so that a large plan
        (DeepSeek-V3: 55 MB) is written without holding its text. Built from per-group templates because a plan
        shares a few Precision / RuleRef objects among tens of thousands of tensors (`_tensor_objects`)."""
        ch = content_hash or self.content_hash()
        empty = self.model_construct(**{**dict(self), "tensors": (), "share_scale_groups": ()})
        head, tail = empty.model_dump_json().split('"tensors":[],"share_scale_groups":[]')
        yield '{"content_hash":' + json.dumps(ch) + "," + head[1:] + '"tensors":['
        sep = ""
        for objects in _tensor_objects(self.tensors):
            yield sep + ",".join(objects)
            sep = ","
        yield '],"share_scale_groups":[' + _groups_json(self.share_scale_groups) + "]" + tail

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        m = re.match(r'\{"content_hash":("[^"]*")(,|\})', text)
        if m:  # our own compact writer: validate the rest with pydantic's Rust JSON parser (fast for 46k tensors)
            expected = json.loads(m.group(1))
            plan = cls.model_validate_json("{" + text[m.end():] if m.group(2) == "," else "{}")
        else:
            d = json.loads(text)
            expected = d.pop("content_hash", None)
            plan = cls.model_validate(d)
        if expected is not None and expected != plan.content_hash():
            raise ValueError(f"plan content hash mismatch: file says {expected}, content is {plan.content_hash()}")
        return plan


def per_precision(key: Callable[["TensorPlan"], Hashable]) -> Callable[["TensorPlan"], Hashable]:
    """`key(t)` - a function of t.precision alone - memoised by the identity of that Precision object, for one pass
    over a plan (which keeps the objects alive): a plan shares a few of them among all its tensors (DeepSeek-V3:
    46k), and hashing the nested formats by value per tensor was most of the checks that compare them."""
    memo: dict[int, Hashable] = {}

    def keyed(t: "TensorPlan") -> Hashable:
        k = memo.get(id(t.precision))
        if k is None:
            k = memo[id(t.precision)] = key(t)
        return k

    return keyed


def _update_joined(h, lines: Iterator[str], per_piece: int = 1024) -> None:
    """`h.update("\\n".join(lines).encode())` a thousand lines at a time, without building the whole text (the
    DeepSeek-V3 contract is 28 MB)."""
    sep = b""
    while True:
        piece = list(itertools.islice(lines, per_piece))
        if not piece:
            return
        h.update(sep + "\n".join(piece).encode())
        sep = b"\n"


# ---- fast compact JSON (same bytes as pydantic's serializer) ----------------------------------------------------------
_enc = json.encoder.encode_basestring  # C; escapes like serde_json ('"', '\\', control chars), keeps non-ASCII


def _cached(cache: dict, obj) -> str:
    s = cache.get(id(obj))
    if s is None:
        s = cache[id(obj)] = obj.model_dump_json() if obj is not None else "null"
    return s


def _value_json(v, cache: dict) -> str:
    """Compact JSON of one field value as pydantic writes it: nested models (Precision, RuleRef) and tuples of
    them cached per object (a plan shares a few among tens of thousands of tensors)."""
    if isinstance(v, Enum):
        return _enc(v.value)
    if isinstance(v, tuple) and all(type(x) is int for x in v):
        return "[" + ",".join(map(str, v)) + "]"
    s = cache.get(id(v))
    if s is None:
        if isinstance(v, BaseModel):
            s = v.model_dump_json()
        elif isinstance(v, tuple):
            s = "[" + ",".join(_value_json(x, cache) for x in v) + "]"
        else:
            raise TypeError(type(v))
        cache[id(v)] = s
    return s


_SCALAR = {str: _enc, int: str, type(None): lambda v: "null", bool: lambda v: "true" if v else "false"}

# The TensorPlan fields that tell tensors of one module group apart, written per tensor into the `%s` holes of a
# template (in this order; their types are fixed by TensorPlan: str, optional str/int, a tuple of ints). Every other
# field (precision, rules, role, fused group, source format: a plan shares a few hundred combinations among tens of
# thousands of tensors) is written once per distinct combination into that template, so the per-tensor work is one
# `%` format of already-encoded values.
_ROW_FIELDS = ("hf_name", "megatron_name", "megatron_part", "sglang_prefix", "layer", "expert", "mtp", "shape",
               "share_scale_group", "bytes_before", "bytes_after")
# The template key (in _tensor_objects) names these explicitly: a generic attrgetter + id() key cost ~1 us per tensor,
# a quarter of the writer. The check keeps the two lists complete when TensorPlan gains a field.
_GROUP_FIELDS = ("role", "is_linear", "precision", "decided_by", "overridden", "fused_group", "source_dtype",
                 "source_format")
if set(_ROW_FIELDS) | set(_GROUP_FIELDS) != set(TensorPlan.model_fields):
    raise RuntimeError("plan._ROW_FIELDS / _GROUP_FIELDS (and the template key in _tensor_objects) must name every "
                       "TensorPlan field")


def _template(t: TensorPlan, cache: dict) -> str:
    """The compact JSON object of `t` in TensorPlan's field order (so a field added to TensorPlan is picked up),
    with a `%s` hole for each row field."""
    parts = []
    for name in TensorPlan.model_fields:
        value = "%s" if name in _ROW_FIELDS else _field_json(t, name, cache).replace("%", "%%")
        parts.append(f'"{name}":{value}')
    return "{" + ",".join(parts) + "}"


def _field_json(t: TensorPlan, name: str, cache: dict) -> str:
    v = getattr(t, name)
    f = _SCALAR.get(type(v))
    if f is not None:
        return f(v)
    try:
        return _value_json(v, cache)
    except TypeError:  # a value type not handled above: pydantic's own JSON of that one field
        return t.model_dump_json(include={name})[len(name) + 4:-1]


def _tensor_objects(tensors, per_piece: int = 1024) -> Iterator[list[str]]:
    """Each tensor's compact JSON object, byte for byte as pydantic writes it, in lists of `per_piece`. Templates are
    keyed by the group fields' values: scalars by value, nested models by identity (a plan holds them all, so the
    ids stay valid; equal values in different objects only make an extra template)."""
    templates: dict[tuple, str] = {}
    fragments: dict = {}  # nested models / tuples -> their JSON, by object
    shapes: dict[int, str] = {}  # shape tuples are shared by the tensors of one shape (arch/_emit.py)
    enc = _enc
    out: list[str] = []
    append = out.append
    for t in tensors:
        if len(out) == per_piece:
            yield out
            out = []
            append = out.append
        d = t.__dict__
        key = (d["role"], d["is_linear"], id(d["precision"]), id(d["decided_by"]), id(d["overridden"]),
               d["fused_group"], d["source_dtype"], id(d["source_format"]))  # = _GROUP_FIELDS
        tpl = templates.get(key)
        if tpl is None:
            tpl = templates[key] = _template(t, fragments)
        shape = d["shape"]
        shape_json = shapes.get(id(shape))
        if shape_json is None:
            shape_json = shapes[id(shape)] = "[" + ",".join(map(str, shape)) + "]"
        meg, part, sg, layer, expert, mtp, group = (d["megatron_name"], d["megatron_part"], d["sglang_prefix"],
                                                     d["layer"], d["expert"], d["mtp"], d["share_scale_group"])
        append(tpl % (
            enc(d["hf_name"]),
            "null" if meg is None else enc(meg),
            "null" if part is None else enc(part),
            "null" if sg is None else enc(sg),
            "null" if layer is None else layer,
            "null" if expert is None else expert,
            "null" if mtp is None else mtp,
            shape_json,
            "null" if group is None else enc(group),
            d["bytes_before"],
            d["bytes_after"],
        ))
    if out:
        yield out


def _groups_json(groups) -> str:
    refs: dict = {}
    return ",".join(f'{{"id":{_enc(g.id)},"members":[{",".join(map(_enc, g.members))}],'
                    f'"declared_at":{_cached(refs, g.declared_at)}}}' for g in groups)
