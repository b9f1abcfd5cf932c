"""Shared building blocks of the adapters: a fast TensorInfo emitter and the sub-blocks every family reuses.

Names come from three places (cite these when changing anything):
  * HF: the checkpoint key names of the public safetensors releases (per-expert
    `model.layers.N.mlp.experts.E.gate_proj.weight`), which is what transformers <= 4.57 also used at runtime.
    transformers 5.x fuses experts at runtime only (3-D `experts.gate_up_proj`); checkpoints keep per-expert keys.
  * Megatron-core 0.16 (PyPI 0.16.1) TE GPT/MoE/MLA specs: `models/gpt/gpt_layer_specs.py`,
    `models/gpt/moe_module_specs.py`, `transformer/multi_latent_attention.py`, `transformer/moe/experts.py`
    (TEGroupedMLP: `linear_fc1.weight{e}` / `linear_fc2.weight{e}`), `transformer/multi_token_prediction.py`
    (`mtp.layers.K.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}`). HF<->Megatron pairs as in
    Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge, commit 067f987df0) `src/megatron/bridge/models/qwen/
    qwen3_moe_bridge.py` / `src/megatron/bridge/models/deepseek/common.py`.
  * SGLang 0.5.23 module prefixes (`python/sglang/srt/models/{llama,qwen2,qwen3,qwen2_moe,qwen3_moe,deepseek_v2,
    deepseek_nextn}.py`): `self_attn.qkv_proj` (QKVParallelLinear), `mlp.gate_up_proj` (MergedColumnParallelLinear),
    `mlp.experts` (FusedMoE, one prefix for all routed experts), `self_attn.fused_qkv_a_proj_with_mqa`, `lm_head`.
    These are the strings SGLang 0.5.23 matches exemptions against (`python/sglang/srt/layers/quantization/
    utils.py` `is_layer_skipped`, `layers/quantization/modelopt_quant.py` `ModelOptQuantConfig.is_layer_excluded`).

Performance: DeepSeek-V3 has ~46k tensors, so TensorInfo objects are built like `model_construct` (no per-tensor
validation; the config was validated once with pydantic) and shape tuples are shared between experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from ._config import BaseLMConfig, GQAConfig
from .base import TensorInfo, unvalidated_constructor

# TensorInfos are built without per-object validation (base.unvalidated_constructor: the same objects as
# model_construct, ~4x faster), which is most of the DeepSeek-V3 load time.
_construct = unvalidated_constructor(TensorInfo, dict(
    hf_name="model.layers.0.mlp.experts.1.gate_proj.weight", shape=(4, 2), dtype="bfloat16",
    role="routed_experts.gate", layer=0, expert=1, mtp=None, megatron_name="m", megatron_part="gate",
    sglang_prefix="s", fused_group="experts.gate_up", source_format=None))


@dataclass(frozen=True, slots=True)
class Scope:
    """Where one decoder block lives in each naming scheme.

    hf:  `model.layers.N` (MTP module k: `model.layers.{num_hidden_layers+k}`)
    meg: `decoder.layers.N` (MTP: `mtp.layers.k.transformer_layer`, Megatron-core 0.16 name)
    sg:  `model.layers.N` (MTP: `model.decoder`, the block inside SGLang's NextN draft model)
    layer / mtp: the TensorInfo tags. MTP tensors have layer=None and mtp=k so that layer slices never select them.
    """

    hf: str
    meg: str
    sg: str
    layer: Optional[int]
    mtp: Optional[int]


def decoder_scope(n: int) -> Scope:
    return Scope(hf=f"model.layers.{n}", meg=f"decoder.layers.{n}", sg=f"model.layers.{n}", layer=n, mtp=None)


class Emitter:
    """Collects TensorInfo objects for one architecture."""

    __slots__ = ("tensors", "dtype")

    def __init__(self, dtype: str) -> None:
        self.tensors: list[TensorInfo] = []
        self.dtype = dtype

    def add(
        self,
        hf_name: str,
        shape: tuple[int, ...],
        role: str,
        scope: Optional[Scope] = None,
        *,
        expert: Optional[int] = None,
        meg: Optional[str] = None,
        part: Optional[str] = None,
        sg: Optional[str] = None,
        fused: Optional[str] = None,
        dtype: Optional[str] = None,
    ) -> None:
        self.tensors.append(_construct({
            "hf_name": hf_name, "shape": shape, "dtype": dtype or self.dtype, "role": role,
            "layer": scope.layer if scope else None, "expert": expert, "mtp": scope.mtp if scope else None,
            "megatron_name": meg, "megatron_part": part, "sglang_prefix": sg, "fused_group": fused,
            "source_format": None}))

    def add_experts(self, s: Scope, n_experts: int, members: tuple[tuple, ...]) -> None:
        """Every routed expert's tensors of one block (~45k of DeepSeek-V3's 46k tensors, hence this dedicated loop:
        `add` per tensor is twice as slow). `members`: (hf leaf, role, Megatron name prefix, part, shape, fused
        group) per tensor of one expert; expert x is `{hf prefix}{x}.{leaf}` / `{Megatron prefix}{x}`."""
        append, dtype, layer, mtp = self.tensors.append, self.dtype, s.layer, s.mtp
        hf, sg = f"{s.hf}.mlp.experts.", f"{s.sg}.mlp.experts"  # FusedMoE: one prefix for every routed expert
        for x in range(n_experts):
            for leaf, role, meg, part, shape, fused in members:
                append(_construct({
                    "hf_name": f"{hf}{x}.{leaf}", "shape": shape, "dtype": dtype, "role": role, "layer": layer,
                    "expert": x, "mtp": mtp, "megatron_name": f"{meg}{x}", "megatron_part": part,
                    "sglang_prefix": sg, "fused_group": fused, "source_format": None}))


# ------------------------------------------------------------------------------------------------------------------
# Top-level tensors
# ------------------------------------------------------------------------------------------------------------------
def emit_embedding(e: Emitter, vocab: int, hidden: int) -> None:
    # Embeddings are VocabParallelEmbedding in SGLang: not a quantizable linear -> no prefix.
    e.add("model.embed_tokens.weight", (vocab, hidden), "embedding", meg="embedding.word_embeddings.weight")


def emit_final_norm_and_head(e: Emitter, vocab: int, hidden: int, tied: bool) -> None:
    e.add("model.norm.weight", (hidden,), "norm.final", meg="decoder.final_layernorm.weight")
    if not tied:
        # Tied checkpoints (tie_word_embeddings=true) have no lm_head.weight at all: SGLang reuses embed_tokens and
        # Megatron shares embedding.word_embeddings (share_embeddings_and_output_weights).
        e.add("lm_head.weight", (vocab, hidden), "lm_head", meg="output_layer.weight", sg="lm_head")


# ------------------------------------------------------------------------------------------------------------------
# Attention (standard GQA: Llama / Mistral / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / GLM-4.5)
# ------------------------------------------------------------------------------------------------------------------
def emit_gqa_attention(e: Emitter, s: Scope, cfg: GQAConfig, *, qk_norm: bool, qkv_bias: bool, o_bias: bool) -> None:
    """input_layernorm + q/k/v/o (+ biases, + per-head q/k norms); the three flags are where the families differ."""
    hidden, head_dim = cfg.hidden_size, cfg.resolved_head_dim
    hf, meg, sg = f"{s.hf}.self_attn", f"{s.meg}.self_attention", f"{s.sg}.self_attn"
    q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim
    # TE spec: input_layernorm is fused into linear_qkv (TELayerNormColumnParallelLinear).
    e.add(f"{s.hf}.input_layernorm.weight", (hidden,), "norm.input", s, meg=f"{meg}.linear_qkv.layer_norm_weight")
    for p, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
        # Megatron linear_qkv is interleaved per KV group ([num_query_groups, (q_per_group+2)*head_dim, hidden]);
        # megatron_part only says which slice, the converter owns the interleave (Bridge QKVMapping).
        e.add(f"{hf}.{p}_proj.weight", (out, hidden), f"attn.{p}", s,
              meg=f"{meg}.linear_qkv.weight", part=p, sg=f"{sg}.qkv_proj", fused="qkv")
        if qkv_bias:
            e.add(f"{hf}.{p}_proj.bias", (out,), "bias.attn", s, meg=f"{meg}.linear_qkv.bias", part=p)
    e.add(f"{hf}.o_proj.weight", (hidden, q_out), "attn.o", s, meg=f"{meg}.linear_proj.weight", sg=f"{sg}.o_proj")
    if o_bias:
        e.add(f"{hf}.o_proj.bias", (hidden,), "bias.attn", s, meg=f"{meg}.linear_proj.bias")
    if qk_norm:
        e.add(f"{hf}.q_norm.weight", (head_dim,), "norm.q", s, meg=f"{meg}.q_layernorm.weight")
        e.add(f"{hf}.k_norm.weight", (head_dim,), "norm.k", s, meg=f"{meg}.k_layernorm.weight")


# ------------------------------------------------------------------------------------------------------------------
# MLPs
# ------------------------------------------------------------------------------------------------------------------
def emit_post_attn_norm(e: Emitter, s: Scope, hidden: int, moe: bool) -> None:
    # TE spec: dense layers fuse this norm into mlp.linear_fc1; MoE layers keep a separate pre_mlp_layernorm.
    meg = f"{s.meg}.pre_mlp_layernorm.weight" if moe else f"{s.meg}.mlp.linear_fc1.layer_norm_weight"
    e.add(f"{s.hf}.post_attention_layernorm.weight", (hidden,), "norm.post_attn", s, meg=meg)


def emit_gated_mlp(
    e: Emitter,
    s: Scope,
    *,
    hidden: int,
    inter: int,
    kind: str = "mlp",
    hf_mod: str = "mlp",
    sg_mod: str = "mlp",
    meg_mod: str = "mlp",
    bias: bool = False,
) -> None:
    """SwiGLU MLP: dense (`kind="mlp"`) or shared expert (`kind="shared_experts"`).

    DeepSeek: hf_mod=sg_mod="mlp.shared_experts"; Qwen2-MoE: hf_mod=sg_mod="mlp.shared_expert" (singular).
    Megatron is `mlp` (dense linear_fc1 = [gate; up]) or `mlp.shared_experts`.
    """
    hf, sg, meg = f"{s.hf}.{hf_mod}", f"{s.sg}.{sg_mod}", f"{s.meg}.{meg_mod}"
    fused = "gate_up" if kind == "mlp" else "shared_experts.gate_up"
    up_shape, down_shape = (inter, hidden), (hidden, inter)
    for p in ("gate", "up"):
        e.add(f"{hf}.{p}_proj.weight", up_shape, f"{kind}.{p}", s,
              meg=f"{meg}.linear_fc1.weight", part=p, sg=f"{sg}.gate_up_proj", fused=fused)
        if bias:
            e.add(f"{hf}.{p}_proj.bias", (inter,), "bias.mlp", s, meg=f"{meg}.linear_fc1.bias", part=p)
    e.add(f"{hf}.down_proj.weight", down_shape, f"{kind}.down", s, meg=f"{meg}.linear_fc2.weight", sg=f"{sg}.down_proj")
    if bias:
        e.add(f"{hf}.down_proj.bias", (hidden,), "bias.mlp", s, meg=f"{meg}.linear_fc2.bias")


def emit_router(e: Emitter, s: Scope, *, hidden: int, n_experts: int, score_bias: bool) -> None:
    # Routers are built with quant_config=None in SGLang (qwen3_moe.py / deepseek_v2.py): no prefix.
    e.add(f"{s.hf}.mlp.gate.weight", (n_experts, hidden), "router.weight", s, meg=f"{s.meg}.mlp.router.weight")
    if score_bias:
        # DeepSeek-V3 stores the aux-loss-free score-correction bias in FP32 (reference inference/model.py Gate.bias).
        e.add(f"{s.hf}.mlp.gate.e_score_correction_bias", (n_experts,), "router.bias", s,
              meg=f"{s.meg}.mlp.router.expert_bias", dtype="float32")


def emit_routed_experts(e: Emitter, s: Scope, *, hidden: int, inter: int, n_experts: int) -> None:
    """Per-expert checkpoint tensors. Megatron names use the GLOBAL expert index (EP=1); under expert parallelism
    TEGroupedMLP holds `weight{e - ep_rank * experts_per_rank}` locally."""
    fc1, fc2 = f"{s.meg}.mlp.experts.linear_fc1.weight", f"{s.meg}.mlp.experts.linear_fc2.weight"
    up_shape, down_shape = (inter, hidden), (hidden, inter)
    e.add_experts(s, n_experts, (
        ("gate_proj.weight", "routed_experts.gate", fc1, "gate", up_shape, "experts.gate_up"),
        ("up_proj.weight", "routed_experts.up", fc1, "up", up_shape, "experts.gate_up"),
        ("down_proj.weight", "routed_experts.down", fc2, None, down_shape, None),
    ))


def emit_ffn(
    e: Emitter,
    s: Scope,
    *,
    hidden: int,
    moe: bool,
    dense_inter: int,
    n_experts: int = 0,
    expert_inter: int = 0,
    score_bias: bool = False,
    shared_inter: int = 0,
    shared_mod: str = "mlp.shared_experts",
) -> None:
    """post_attention_layernorm and the block's feed-forward: a dense SwiGLU MLP of `dense_inter`, or (moe) the
    router, the routed experts and, when `shared_inter` > 0, the shared expert at HF / SGLang module `shared_mod`
    (DeepSeek / GLM `mlp.shared_experts`, Qwen2-MoE `mlp.shared_expert`; Megatron `mlp.shared_experts` for all)."""
    emit_post_attn_norm(e, s, hidden, moe=moe)
    if not moe:
        emit_gated_mlp(e, s, hidden=hidden, inter=dense_inter)
        return
    emit_router(e, s, hidden=hidden, n_experts=n_experts, score_bias=score_bias)
    emit_routed_experts(e, s, hidden=hidden, inter=expert_inter, n_experts=n_experts)
    if shared_inter:
        emit_gated_mlp(e, s, hidden=hidden, inter=shared_inter, kind="shared_experts",
                       hf_mod=shared_mod, sg_mod=shared_mod, meg_mod="mlp.shared_experts")


# ------------------------------------------------------------------------------------------------------------------
# DeepSeekMoE layout and MTP (DeepSeek-V2 / V3, GLM-4.5: the same config fields and checkpoint layout)
# ------------------------------------------------------------------------------------------------------------------
class DeepseekMoeFields(Protocol):
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    intermediate_size: int
    moe_intermediate_size: Optional[int]
    n_routed_experts: Optional[int]
    n_shared_experts: Optional[int]
    first_k_dense_replace: int
    num_nextn_predict_layers: int

    def is_moe_layer(self, n: int) -> bool: ...


def deepseek_summary(cfg: DeepseekMoeFields) -> dict[str, int]:
    """Architecture summary fields of a DeepSeekMoE-layout config (no routed experts: every layer is dense)."""
    moe = bool(cfg.n_routed_experts)
    return {
        "num_experts": cfg.n_routed_experts or 0,
        "num_shared_experts": (cfg.n_shared_experts or 0) if moe else 0,
        "first_dense_layers": min(cfg.first_k_dense_replace, cfg.num_hidden_layers) if moe else cfg.num_hidden_layers,
        "num_mtp_layers": cfg.num_nextn_predict_layers,
    }


def emit_deepseek_ffn(e: Emitter, s: Scope, cfg: DeepseekMoeFields, index: int, *, score_bias: bool) -> None:
    """The feed-forward of HF layer `index` (the index decides dense vs MoE, MTP blocks included): routed experts of
    moe_intermediate_size, shared experts of moe_intermediate_size * n_shared_experts."""
    moe = cfg.is_moe_layer(index)
    shared = (cfg.n_shared_experts or 0) * cfg.moe_intermediate_size if moe else 0
    emit_ffn(e, s, hidden=cfg.hidden_size, moe=moe, dense_inter=cfg.intermediate_size,
             n_experts=cfg.n_routed_experts or 0, expert_inter=cfg.moe_intermediate_size or 0,
             score_bias=score_bias, shared_inter=shared)


Block = Callable[[Emitter, Scope, int], None]  # emits one decoder block given its scope and HF layer index


def emit_mtp(e: Emitter, cfg: BaseLMConfig, k: int, block: Block) -> None:
    """MTP module k at HF `model.layers.{num_hidden_layers + k}`: embed_tokens, enorm, hnorm, eh_proj [h, 2h], one
    decoder block, shared_head.norm, shared_head.head (DeepSeek-V3 and GLM-4.5 checkpoints alike)."""
    L, h, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    hf, meg = f"model.layers.{L + k}", f"mtp.layers.{k}"
    s = Scope(hf=hf, meg=f"{meg}.transformer_layer", sg="model.decoder", layer=None, mtp=k)
    # Megatron MTP shares the main model's embedding.word_embeddings / output_layer: no parameter of its own.
    e.add(f"{hf}.embed_tokens.weight", (v, h), "mtp.embedding", s)
    e.add(f"{hf}.enorm.weight", (h,), "norm.mtp", s, meg=f"{meg}.enorm.weight")
    e.add(f"{hf}.hnorm.weight", (h,), "norm.mtp", s, meg=f"{meg}.hnorm.weight")
    e.add(f"{hf}.eh_proj.weight", (h, 2 * h), "mtp.eh_proj", s, meg=f"{meg}.eh_proj.weight")
    block(e, s, L + k)
    e.add(f"{hf}.shared_head.norm.weight", (h,), "norm.mtp", s, meg=f"{meg}.final_layernorm.weight")
    e.add(f"{hf}.shared_head.head.weight", (v, h), "mtp.lm_head", s, sg="model.shared_head.head")


# ------------------------------------------------------------------------------------------------------------------
# The whole model
# ------------------------------------------------------------------------------------------------------------------
def emit_decoder_model(cfg: BaseLMConfig, block: Block, num_mtp: int = 0) -> list[TensorInfo]:
    """Every tensor in checkpoint order: embedding, the decoder blocks, final norm (+ lm_head), `num_mtp` MTP
    modules. `block` is the family's decoder block; every family shares this order."""
    e = Emitter(cfg.checkpoint_dtype)
    emit_embedding(e, cfg.vocab_size, cfg.hidden_size)
    for n in range(cfg.num_hidden_layers):
        block(e, decoder_scope(n), n)
    emit_final_norm_and_head(e, cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings)
    for k in range(num_mtp):
        emit_mtp(e, cfg, k, block)
    return e.tensors
