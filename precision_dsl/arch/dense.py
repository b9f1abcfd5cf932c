"""Dense decoder families: llama, mistral, qwen2, qwen3 (one GQA attention + one SwiGLU MLP per layer).

Differences that change the tensor list (transformers 5.x modeling files, which match the public checkpoints):
  * qwen2: q/k/v always carry a bias (o_proj none).
  * qwen3: per-head q_norm / k_norm; `attention_bias` adds q/k/v/o biases.
  * llama: `attention_bias` adds q/k/v/o biases, `mlp_bias` adds gate/up/down biases.
  * mistral: no biases.
`head_dim` defaults to hidden_size // num_attention_heads when absent or null.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import model_validator

from ._config import BaseLMConfig, HeadDim, Inner, StrictBool, validate_config
from ._emit import (
    Emitter,
    decoder_scope,
    emit_embedding,
    emit_final_norm_and_head,
    emit_gated_mlp,
    emit_gqa_attention,
    emit_post_attn_norm,
)
from .base import TensorInfo

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class DenseConfig(BaseLMConfig):
    intermediate_size: Inner
    head_dim: Optional[HeadDim] = None
    attention_bias: StrictBool = False
    mlp_bias: StrictBool = False

    @model_validator(mode="after")
    def _check_head_dim(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"head_dim is not given and hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def parse(raw: dict[str, Any], source: str) -> DenseConfig:
    return validate_config(DenseConfig, raw, source)


def emit(cfg: DenseConfig) -> list[TensorInfo]:
    mt = cfg.model_type
    qkv_bias = mt == "qwen2" or (mt in ("llama", "qwen3") and cfg.attention_bias)
    o_bias = mt in ("llama", "qwen3") and cfg.attention_bias
    mlp_bias = mt == "llama" and cfg.mlp_bias
    e = Emitter(cfg.checkpoint_dtype)
    h = cfg.hidden_size
    emit_embedding(e, cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        s = decoder_scope(n)
        emit_gqa_attention(e, s, hidden=h, n_heads=cfg.num_attention_heads, n_kv=cfg.kv_heads,
                           head_dim=cfg.resolved_head_dim, qk_norm=mt == "qwen3", qkv_bias=qkv_bias, o_bias=o_bias)
        emit_post_attn_norm(e, s, h, moe=False)
        emit_gated_mlp(e, s, hidden=h, inter=cfg.intermediate_size, bias=mlp_bias)
    emit_final_norm_and_head(e, cfg.vocab_size, h, cfg.tie_word_embeddings)
    return e.tensors


def summary(cfg: DenseConfig) -> dict[str, int]:
    return {"num_experts": 0, "num_shared_experts": 0, "first_dense_layers": 0, "num_mtp_layers": 0}
