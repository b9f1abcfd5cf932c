"""DeepSeek families: deepseek_v3 (DeepSeek-V3 / R1) and deepseek_v2 (V2, V2-Lite): MLA attention + DeepSeekMoE + MTP.

Tensor list per decoder layer n (HF checkpoint names, `model.layers.n.` prefix):
  input_layernorm, self_attn.{q_a_proj, q_a_layernorm, q_b_proj} (q_lora_rank set) or self_attn.q_proj (V2-Lite),
  self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, post_attention_layernorm, then
  dense mlp.{gate,up,down}_proj for n < first_k_dense_replace (or n % moe_layer_freq != 0), else
  mlp.gate.weight, mlp.gate.e_score_correction_bias (V3 / topk_method noaux_tc; FP32), mlp.experts.E.*, and
  mlp.shared_experts.* with intermediate moe_intermediate_size * n_shared_experts.
MTP module k (num_nextn_predict_layers) is `model.layers.{num_hidden_layers + k}`: embed_tokens, enorm, hnorm,
eh_proj [hidden, 2*hidden], a full decoder layer (MoE when its index qualifies), shared_head.norm, shared_head.head.

Megatron-core 0.16 MLA spec (`gpt_layer_specs.py` MLA branch, TE, qk_layernorm): input_layernorm stays a separate
module; q_a_layernorm / kv_a_layernorm are the `layer_norm_weight` of linear_q_up_proj / linear_kv_up_proj.
SGLang 0.5.23 (`models/deepseek_v2.py`): q_a_proj + kv_a_proj_with_mqa are one module `fused_qkv_a_proj_with_mqa`
when q_lora_rank is set; without q-LoRA they are `q_proj` and `kv_a_proj_with_mqa`. The MTP block is served by a
separate draft model (`models/deepseek_nextn.py`, DeepseekV3ForCausalLMNextN): its decoder layer is
`model.decoder.*`, eh_proj is a plain nn.Linear (never quantized), and embed_tokens / shared_head.head are taken from
the target model (prefix `model.shared_head.head` kept for exemption lists).
Note: the public DeepSeek-V3 release stores linears as FP8 (config quantization_config, 128x128 blocks) with a
`<module>.weight_scale_inv` FP32 tensor each; this catalog lists the logical weights in torch_dtype (what training
sees after dequantization); scale tensors are a storage detail of that release (see Architecture.config).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import Field, model_validator

from ._config import BaseLMConfig, Count, Experts, HeadDim, Inner, Layers, StrictBool, validate_config
from ._emit import Emitter, Scope, deepseek_summary, emit_decoder_model, emit_deepseek_ffn
from .base import TensorInfo

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")

Rank = Annotated[int, Field(strict=True, ge=1, le=65_536)]


class DeepseekConfig(BaseLMConfig):
    intermediate_size: Inner
    moe_intermediate_size: Optional[Inner] = None
    n_routed_experts: Optional[Experts] = None  # None -> dense model (as in the reference modeling code)
    n_shared_experts: Optional[Count] = None
    num_experts_per_tok: Optional[Annotated[int, Field(strict=True, ge=1, le=4_096)]] = None
    first_k_dense_replace: Annotated[int, Field(strict=True, ge=0, le=1_024)] = 0
    moe_layer_freq: Layers = 1
    q_lora_rank: Optional[Rank] = None
    kv_lora_rank: Rank
    qk_nope_head_dim: HeadDim
    qk_rope_head_dim: HeadDim
    v_head_dim: HeadDim
    num_nextn_predict_layers: Count = 0
    topk_method: Optional[str] = None
    attention_bias: StrictBool = False

    @model_validator(mode="after")
    def _check(self):
        if self.attention_bias:
            raise ValueError("attention_bias=true is not supported for DeepSeek MLA (no released model uses it)")
        if self.n_routed_experts:
            if self.moe_intermediate_size is None:
                raise ValueError("n_routed_experts is set but moe_intermediate_size is missing")
            if self.num_experts_per_tok is not None and self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                    f"({self.n_routed_experts})"
                )
        return self

    def is_moe_layer(self, n: int) -> bool:
        # Reference modeling_deepseek.py (V2 and V3): routed MoE iff experts exist, n >= first_k_dense_replace and
        # n % moe_layer_freq == 0. Applies to MTP blocks too (their index is num_hidden_layers + k).
        return bool(self.n_routed_experts) and n >= self.first_k_dense_replace and n % self.moe_layer_freq == 0

    @property
    def has_score_bias(self) -> bool:
        # V3 always has e_score_correction_bias (transformers DeepseekV3TopkRouter); V2 only with noaux_tc routing.
        return self.model_type == "deepseek_v3" or self.topk_method == "noaux_tc"


def emit_mla_attention(e: Emitter, s: Scope, cfg: DeepseekConfig) -> None:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    hf, meg, sg = f"{s.hf}.self_attn", f"{s.meg}.self_attention", f"{s.sg}.self_attn"
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    e.add(f"{s.hf}.input_layernorm.weight", (h,), "norm.input", s, meg=f"{s.meg}.input_layernorm.weight")
    if cfg.q_lora_rank:
        r = cfg.q_lora_rank
        fused_a = f"{sg}.fused_qkv_a_proj_with_mqa"
        e.add(f"{hf}.q_a_proj.weight", (r, h), "attn.q_a", s,
              meg=f"{meg}.linear_q_down_proj.weight", sg=fused_a, fused="q_a+kv_a")
        e.add(f"{hf}.q_a_layernorm.weight", (r,), "norm.q_a", s, meg=f"{meg}.linear_q_up_proj.layer_norm_weight")
        e.add(f"{hf}.q_b_proj.weight", (heads * qk_head, r), "attn.q_b", s,
              meg=f"{meg}.linear_q_up_proj.weight", sg=f"{sg}.q_b_proj")
        kv_a_sg, kv_a_fused = fused_a, "q_a+kv_a"
    else:
        e.add(f"{hf}.q_proj.weight", (heads * qk_head, h), "attn.q", s,
              meg=f"{meg}.linear_q_proj.weight", sg=f"{sg}.q_proj")
        kv_a_sg, kv_a_fused = f"{sg}.kv_a_proj_with_mqa", None
    kv = cfg.kv_lora_rank
    e.add(f"{hf}.kv_a_proj_with_mqa.weight", (kv + cfg.qk_rope_head_dim, h), "attn.kv_a", s,
          meg=f"{meg}.linear_kv_down_proj.weight", sg=kv_a_sg, fused=kv_a_fused)
    e.add(f"{hf}.kv_a_layernorm.weight", (kv,), "norm.kv_a", s, meg=f"{meg}.linear_kv_up_proj.layer_norm_weight")
    e.add(f"{hf}.kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv), "attn.kv_b", s,
          meg=f"{meg}.linear_kv_up_proj.weight", sg=f"{sg}.kv_b_proj")
    e.add(f"{hf}.o_proj.weight", (h, heads * cfg.v_head_dim), "attn.o", s,
          meg=f"{meg}.linear_proj.weight", sg=f"{sg}.o_proj")


def emit_block(e: Emitter, s: Scope, cfg: DeepseekConfig, index: int) -> None:
    """One decoder block; `index` is its HF layer index (decides dense vs MoE)."""
    emit_mla_attention(e, s, cfg)
    emit_deepseek_ffn(e, s, cfg, index, score_bias=cfg.has_score_bias)


def parse(raw: dict[str, Any], source: str) -> DeepseekConfig:
    return validate_config(DeepseekConfig, raw, source)


def emit(cfg: DeepseekConfig) -> list[TensorInfo]:
    return emit_decoder_model(cfg, lambda e, s, n: emit_block(e, s, cfg, n), cfg.num_nextn_predict_layers)


def summary(cfg: DeepseekConfig) -> dict[str, int]:
    return deepseek_summary(cfg)
