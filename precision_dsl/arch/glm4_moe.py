"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 MoE family (HF `Glm4MoeForCausalLM`, model_type `glm4_moe`).

Tensor list per decoder layer n (HF checkpoint names, `model.layers.n.` prefix), from transformers 5.24
`models/glm4_moe/modeling_glm4_moe.py` (checked name for name by tests/test_arch_oracle.py on the meta device):
  input_layernorm, self_attn.{q,k,v}_proj.weight (+ .bias when attention_bias: GLM-4.5 sets it), self_attn.o_proj
  (never a bias), self_attn.{q,k}_norm [head_dim] when use_qk_norm (GLM-4.5: true, GLM-4.5-Air: false),
  post_attention_layernorm, then
  dense mlp.{gate,up,down}_proj of intermediate_size for n < first_k_dense_replace, else
  mlp.gate.weight [E, hidden], mlp.gate.e_score_correction_bias [E] (FP32 in the checkpoint, like DeepSeek-V3),
  mlp.experts.E.{gate,up,down}_proj of moe_intermediate_size and mlp.shared_experts.{gate,up,down}_proj of
  moe_intermediate_size * n_shared_experts.
`head_dim` is explicit in the public configs (GLM-4.5-Air: 128 while hidden/heads = 42.67); transformers falls back to
hidden_size // num_attention_heads. `partial_rotary_factor` (0.5; transformers 5 writes it inside `rope_parameters`)
changes no tensor: RoPE has no parameters.
MTP module k (num_nextn_predict_layers; transformers 5 calls it num_mtp_layers) is `model.layers.{L + k}` with the
same layout as DeepSeek-V3's: embed_tokens, enorm, hnorm, eh_proj [hidden, 2*hidden], one MoE decoder layer,
shared_head.norm, shared_head.head. transformers does not build it (`_keys_to_ignore_on_load_unexpected`
`model\\.layers\\.46.*` / `92.*`).

Megatron-core 0.16 (TE spec, GQA): linear_qkv (+ .bias: add_qkv_bias), linear_proj, q_layernorm / k_layernorm,
dense layers fuse post_attention_layernorm into mlp.linear_fc1.layer_norm_weight, MoE layers keep pre_mlp_layernorm,
mlp.router.{weight, expert_bias}, mlp.experts.linear_fc{1,2}.weight{e}, mlp.shared_experts.linear_fc{1,2}; MTP
`mtp.layers.k.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}` (checked by building GPTModel).
SGLang 0.5.23 (`python/sglang/srt/models/glm4_moe.py`): `self_attn.qkv_proj` (QKVParallelLinear, bias=attention_bias),
`self_attn.o_proj`, `mlp.gate_up_proj` / `mlp.down_proj` (Glm4MoeMLP), `mlp.experts` (FusedMoE),
`mlp.shared_experts.gate_up_proj` / `.down_proj`; the gate is a plain FP32 nn.Parameter (no quant method, no prefix).
The MTP layer is served by `glm4_moe_nextn.py` (Glm4MoeForCausalLMNextN): decoder `model.decoder.*`, eh_proj a plain
nn.Linear, embed_tokens / shared_head.head taken from the target model (`model.shared_head.head` prefix kept).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import Field, model_validator

from ._config import Count, Experts, GQAConfig, Inner, StrictBool, validate_config
from ._emit import Emitter, Scope, deepseek_summary, emit_decoder_model, emit_deepseek_ffn, emit_gqa_attention
from .base import TensorInfo

MODEL_TYPES = ("glm4_moe",)
# transformers 5 attribute names (Glm4MoeConfig.attribute_map) -> the public config.json names read here.
ALIASES = {"num_mtp_layers": "num_nextn_predict_layers", "num_local_experts": "n_routed_experts"}


class Glm4MoeConfig(GQAConfig):
    intermediate_size: Inner
    moe_intermediate_size: Inner
    n_routed_experts: Optional[Experts] = None  # None -> dense model (SGLang `_is_layer_sparse`)
    n_shared_experts: Optional[Count] = None
    num_experts_per_tok: Annotated[int, Field(strict=True, ge=1, le=4_096)] = 8
    first_k_dense_replace: Annotated[int, Field(strict=True, ge=0, le=1_024)] = 1  # transformers default
    attention_bias: StrictBool = False  # transformers default; GLM-4.5 configs set true
    use_qk_norm: StrictBool = False
    num_nextn_predict_layers: Count = 0
    partial_rotary_factor: Optional[float] = None

    @model_validator(mode="after")
    def _check(self):
        if self.n_routed_experts and self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        return self

    def is_moe_layer(self, n: int) -> bool:
        # transformers Glm4MoeDecoderLayer / SGLang `_is_layer_sparse`: MoE iff experts exist and
        # n >= first_k_dense_replace; MTP blocks (n >= num_hidden_layers) qualify the same way.
        return bool(self.n_routed_experts) and n >= self.first_k_dense_replace


def _emit_block(e: Emitter, s: Scope, cfg: Glm4MoeConfig, index: int) -> None:
    emit_gqa_attention(e, s, cfg, qk_norm=cfg.use_qk_norm, qkv_bias=cfg.attention_bias, o_bias=False)
    emit_deepseek_ffn(e, s, cfg, index, score_bias=True)


def parse(raw: dict[str, Any], source: str) -> Glm4MoeConfig:
    raw = dict(raw)
    rope = raw.get("rope_parameters")
    if raw.get("partial_rotary_factor") is None and isinstance(rope, dict):
        raw["partial_rotary_factor"] = rope.get("partial_rotary_factor")  # transformers 5 nests it here
    return validate_config(Glm4MoeConfig, raw, source)


def emit(cfg: Glm4MoeConfig) -> list[TensorInfo]:
    return emit_decoder_model(cfg, lambda e, s, n: _emit_block(e, s, cfg, n), cfg.num_nextn_predict_layers)


def summary(cfg: Glm4MoeConfig) -> dict[str, int]:
    return deepseek_summary(cfg)
