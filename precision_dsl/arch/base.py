"""Architecture catalog data model: every tensor of a model, as the HF checkpoint names it.

An adapter (one per `model_type`) turns a HuggingFace `config.json` into an `Architecture`: the exact list of
checkpoint tensors (per-expert names, not transformers' runtime-fused ones) with shape, layer, role, and the
names the other consumers use (Megatron-core parameter name, SGLang module prefix). Pure Python: no torch.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TypeVar

from pydantic import BaseModel, ConfigDict

from ..precision import TensorFormat

# ---------------------------------------------------------------------------------------------------------------
# Roles. A role is "<group>.<member>"; selectors in the policy language match a whole group ("routed_experts"),
# a member ("routed_experts.gate"), or a set of members ("routed_experts.{gate, up}").
# Only roles in LINEAR_ROLES are GEMM weights that can be quantized; the rest may only take bf16/fp16/fp32.
# ---------------------------------------------------------------------------------------------------------------
ROLES: dict[str, str] = {
    "embedding": "token embedding table (model.embed_tokens)",
    "lm_head": "output projection (lm_head)",
    "norm.final": "final RMSNorm (model.norm)",
    "norm.input": "pre-attention RMSNorm (input_layernorm)",
    "norm.post_attn": "pre-MLP RMSNorm (post_attention_layernorm)",
    "norm.q": "Qwen3 per-head q_norm",
    "norm.k": "Qwen3 per-head k_norm",
    "norm.q_a": "MLA q_a_layernorm",
    "norm.kv_a": "MLA kv_a_layernorm",
    "norm.mtp": "MTP enorm / hnorm / shared_head.norm",
    "router.weight": "MoE router (mlp.gate.weight)",
    "router.bias": "MoE router score-correction bias (e_score_correction_bias)",
    "attn.q": "attention q_proj",
    "attn.k": "attention k_proj",
    "attn.v": "attention v_proj",
    "attn.o": "attention o_proj",
    "attn.q_a": "MLA q_a_proj (q down-projection)",
    "attn.q_b": "MLA q_b_proj (q up-projection)",
    "attn.kv_a": "MLA kv_a_proj_with_mqa (kv down-projection)",
    "attn.kv_b": "MLA kv_b_proj (kv up-projection)",
    "mlp.gate": "dense MLP gate_proj",
    "mlp.up": "dense MLP up_proj",
    "mlp.down": "dense MLP down_proj",
    "routed_experts.gate": "routed expert gate_proj",
    "routed_experts.up": "routed expert up_proj",
    "routed_experts.down": "routed expert down_proj",
    "shared_experts.gate": "shared expert gate_proj",
    "shared_experts.up": "shared expert up_proj",
    "shared_experts.down": "shared expert down_proj",
    "shared_experts.gate_weight": "Qwen2-MoE style sigmoid gate of the shared expert",
    "mtp.eh_proj": "MTP projection of [embedding; hidden] (eh_proj)",
    "mtp.embedding": "MTP layer's own embedding copy (DeepSeek-V3 checkpoint: embed_tokens)",
    "mtp.lm_head": "MTP layer's shared_head.head",
    # Biases are never GEMM weights, so they get their own group rather than riding on attn.q / mlp.gate (which
    # would make `is_linear` true for a 1-D bias).
    "bias.attn": "attention projection bias (Qwen2 / Qwen2-MoE q,k,v; attention_bias=true)",
    "bias.mlp": "dense MLP projection bias (Llama mlp_bias=true)",
}

LINEAR_ROLES = frozenset({
    "lm_head", "attn.q", "attn.k", "attn.v", "attn.o", "attn.q_a", "attn.q_b", "attn.kv_a", "attn.kv_b",
    "mlp.gate", "mlp.up", "mlp.down", "routed_experts.gate", "routed_experts.up", "routed_experts.down",
    "shared_experts.gate", "shared_experts.up", "shared_experts.down", "mtp.eh_proj", "mtp.lm_head",
})

ROLE_GROUPS = sorted({r.split(".")[0] for r in ROLES})

# Sibling sets that serving engines fuse into one GEMM; they must agree in format (checked at plan time).
# Keyed by a fused-group name; members are roles. The group instance is (layer, expert, mtp) + this name.
FUSED_SIBLINGS: dict[str, tuple[str, ...]] = {
    "qkv": ("attn.q", "attn.k", "attn.v"),
    "q_a+kv_a": ("attn.q_a", "attn.kv_a"),
    "gate_up": ("mlp.gate", "mlp.up"),
    "experts.gate_up": ("routed_experts.gate", "routed_experts.up"),
    "shared_experts.gate_up": ("shared_experts.gate", "shared_experts.up"),
}


class CheckpointTensor:
    """What a checkpoint tensor's fields imply, shared by the catalog's TensorInfo and the plan's TensorPlan (both
    carry hf_name, shape, layer, expert, mtp and fused_group)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def fused_key(self) -> Optional[tuple]:
        """The fused-sibling INSTANCE this tensor belongs to -- (group, mtp, layer, expert): one layer's q/k/v, one
        expert's gate/up -- or None. The one definition every consumer uses (checks, the resolver's share-scale
        groups, SGLang, weight-update atomic groups)."""
        g = self.fused_group
        return None if g is None else (g, self.mtp, self.layer, self.expert)


M = TypeVar("M", bound=BaseModel)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while tens of thousands of model objects are built (the architecture's TensorInfos, the
    plan's TensorPlans): otherwise allocation-triggered collections rescan every live object again and again
    (DeepSeek-V3 resolve: 0.42 s instead of 0.24 s CPU with the default GC thresholds). The builders make no cycles,
    and the previous state is always restored."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def unvalidated_constructor(model: type[M], sample: dict) -> Callable[[dict], M]:
    """`make(values)`: a `model` instance from a dict holding EVERY field's value in declaration order, without
    validation -- for objects valid by construction that are built by the ten thousand (DeepSeek-V3: 46k TensorInfos,
    then 46k TensorPlans). The result equals what `model.model_construct(**values)` returns (pydantic 2 sets
    `__dict__`, `__pydantic_fields_set__`, `__pydantic_extra__`, `__pydantic_private__`) without its per-call field
    loop, ~4x faster. `values` becomes the instance's `__dict__` (not copied). All instances share ONE fields-set
    (~1 KB each otherwise, 90 MB over DeepSeek-V3's plan): it holds every field, so pydantic's only in-place change
    to it, `add(field)` on assignment, could not alter it (and these models are frozen); copies get their own.
    The equivalence is checked on `sample` here; if pydantic's internals ever differ, `make` is model_construct."""
    fields = tuple(model.model_fields)
    every_field = set(fields)
    new, set_attr = object.__new__, object.__setattr__

    def construct_unvalidated(values: dict) -> M:
        obj = new(model)
        set_attr(obj, "__dict__", values)
        set_attr(obj, "__pydantic_fields_set__", every_field)
        set_attr(obj, "__pydantic_extra__", None)
        set_attr(obj, "__pydantic_private__", None)
        return obj

    def construct_via_pydantic(values: dict) -> M:
        return model.model_construct(**values)

    ref, fast = model.model_construct(**sample), construct_unvalidated(dict(sample))
    same = all(getattr(ref, a, None) == getattr(fast, a, None)
               for a in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")) \
        and list(ref.__dict__) == list(fields) == list(fast.__dict__) and ref == fast \
        and model.model_config.get("frozen") and fast.model_copy().model_fields_set is not every_field
    return construct_unvalidated if same else construct_via_pydantic


class TensorInfo(CheckpointTensor, BaseModel):
    """One checkpoint tensor."""

    model_config = ConfigDict(frozen=True)

    hf_name: str  # e.g. model.layers.3.mlp.experts.17.gate_proj.weight
    shape: tuple[int, ...]  # HF layout: Linear weights are [out_features, in_features]
    dtype: str = "bfloat16"  # checkpoint dtype of the source tensor
    role: str  # key of ROLES
    layer: Optional[int] = None  # decoder block index (0-based); None for embedding/lm_head/final norm
    expert: Optional[int] = None  # routed-expert index
    mtp: Optional[int] = None  # MTP module index k (its HF layer index is num_hidden_layers + k)
    megatron_name: Optional[str] = None  # e.g. decoder.layers.3.mlp.experts.linear_fc1.weight17 (None: no equivalent)
    megatron_part: Optional[str] = None  # how the HF tensor sits inside the Megatron one: "gate"|"up"|"q"|"k"|"v"
    sglang_prefix: Optional[str] = None  # SGLang module prefix, e.g. model.layers.3.mlp.experts (FusedMoE)
    # (with shared-expert fusion off: whether SGLang fuses a shared expert into mlp.experts depends on the launch,
    # which only the SGLang backend decides: backends/sglang.py serving_prefix)
    fused_group: Optional[str] = None  # key of FUSED_SIBLINGS this tensor belongs to, if any
    # How the source checkpoint STORES this tensor when that differs from `dtype` (the logical dtype training sees):
    # an FP8-block release (DeepSeek-V3, Kimi-K2: quantization_config quant_method fp8) stores most linears as
    # e4m3 + a `<module>.weight_scale_inv` fp32 grid. None: stored as `dtype`. Set by arch/source.py.
    source_format: Optional[TensorFormat] = None

    @property
    def is_linear(self) -> bool:
        return self.role in LINEAR_ROLES

    @property
    def module(self) -> str:
        """HF module path (name without the trailing `.weight` / `.bias`)."""
        return self.hf_name.rsplit(".", 1)[0]


class Architecture(BaseModel):
    """A resolved model architecture: what the policy resolver and the backends need."""

    model_config = ConfigDict(frozen=True)

    name: str  # bundled name or path it was loaded from
    model_type: str  # HF model_type: qwen3_moe | deepseek_v3 | llama | qwen3 | ...
    num_layers: int  # decoder blocks (num_hidden_layers), MTP excluded
    num_mtp_layers: int = 0
    num_experts: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0  # DeepSeek first_k_dense_replace
    source_model_type: Optional[str] = None  # config.json model_type when it differs (kimi_k2 -> deepseek_v3)
    architecture: Optional[str] = None  # the HF architecture class the family was chosen by, if the config names one
    source_quantization: Optional[str] = None  # quantization_config.quant_method of the release (fp8: FP8-block)
    hidden_size: int
    config: dict  # the raw config.json (for backends that need more fields)
    tensors: tuple[TensorInfo, ...]

    @property
    def total_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.hf_name: t for t in self.tensors}
