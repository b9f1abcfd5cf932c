"""Qwen MoE families: qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B) and qwen2_moe (Qwen1.5-MoE / Qwen2-57B-A14B).

Layer n is sparse iff n not in mlp_only_layers and num_experts > 0 and (n + 1) % decoder_sparse_step == 0
(transformers Qwen3MoeDecoderLayer / Qwen2MoeDecoderLayer); otherwise it has a dense MLP of intermediate_size.
  * qwen3_moe: q_norm / k_norm, no shared expert; `attention_bias` adds q/k/v/o biases.
  * qwen2_moe: q/k/v bias (`qkv_bias`, default true); ONE shared expert, named in the singular
    `mlp.shared_expert.{gate,up,down}_proj` (SGLang prefix `mlp.shared_expert.gate_up_proj`), plus the sigmoid gate
    `mlp.shared_expert_gate.weight` [1, hidden] (Megatron `mlp.shared_experts.gate_weight`; SGLang builds it as an
    unquantized Linear -> no prefix).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import Field, model_validator

from ._config import Experts, GQAConfig, Inner, Layers, StrictBool, validate_config
from ._emit import Emitter, Scope, emit_decoder_model, emit_ffn, emit_gqa_attention
from .base import TensorInfo

MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
# transformers 5 saves Qwen3-MoE / Qwen2-MoE configs with `num_local_experts` (its attribute name) for `num_experts`.
ALIASES = {"num_local_experts": "num_experts"}


class QwenMoeConfig(GQAConfig):
    intermediate_size: Inner  # dense (mlp_only) layers
    moe_intermediate_size: Inner
    num_experts: Experts
    num_experts_per_tok: Annotated[int, Field(strict=True, ge=1, le=4_096)]
    decoder_sparse_step: Layers = 1
    mlp_only_layers: Optional[list[Annotated[int, Field(strict=True, ge=0)]]] = None
    attention_bias: StrictBool = False
    qkv_bias: StrictBool = True  # qwen2_moe only
    shared_expert_intermediate_size: Annotated[int, Field(strict=True, ge=0, le=1_048_576)] = 0  # qwen2_moe only

    @model_validator(mode="after")
    def _check(self):
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        return self

    def is_moe_layer(self, n: int) -> bool:
        return (
            n not in (self.mlp_only_layers or ())
            and self.num_experts > 0
            and (n + 1) % self.decoder_sparse_step == 0
        )


def parse(raw: dict[str, Any], source: str) -> QwenMoeConfig:
    return validate_config(QwenMoeConfig, raw, source)


def emit(cfg: QwenMoeConfig) -> list[TensorInfo]:
    qwen2 = cfg.model_type == "qwen2_moe"
    h = cfg.hidden_size
    shared = cfg.shared_expert_intermediate_size if qwen2 else 0

    def block(e: Emitter, s: Scope, n: int) -> None:
        emit_gqa_attention(e, s, cfg, qk_norm=not qwen2, qkv_bias=cfg.qkv_bias if qwen2 else cfg.attention_bias,
                           o_bias=(not qwen2) and cfg.attention_bias)
        moe = cfg.is_moe_layer(n)
        emit_ffn(e, s, hidden=h, moe=moe, dense_inter=cfg.intermediate_size, n_experts=cfg.num_experts,
                 expert_inter=cfg.moe_intermediate_size, shared_inter=shared, shared_mod="mlp.shared_expert")
        if moe and shared:
            e.add(f"{s.hf}.mlp.shared_expert_gate.weight", (1, h), "shared_experts.gate_weight", s,
                  meg=f"{s.meg}.mlp.shared_experts.gate_weight")

    return emit_decoder_model(cfg, block)


def summary(cfg: QwenMoeConfig) -> dict[str, int]:
    leading_dense = 0
    while leading_dense < cfg.num_hidden_layers and not cfg.is_moe_layer(leading_dense):
        leading_dense += 1
    shared = int(cfg.model_type == "qwen2_moe" and cfg.shared_expert_intermediate_size > 0)
    return {"num_experts": cfg.num_experts, "num_shared_experts": shared, "first_dense_layers": leading_dense,
            "num_mtp_layers": 0}
