"""Dense decoder families: llama, mistral, qwen2, qwen3 (one GQA attention + one SwiGLU MLP per layer).

Differences that change the tensor list (transformers 5.x modeling files, which match the public checkpoints):
  * qwen2: q/k/v always carry a bias (o_proj none).
  * qwen3: per-head q_norm / k_norm; `attention_bias` adds q/k/v/o biases.
  * llama: `attention_bias` adds q/k/v/o biases, `mlp_bias` adds gate/up/down biases.
  * mistral: no biases.
`head_dim` defaults to hidden_size // num_attention_heads when absent or null.
"""

from __future__ import annotations

from typing import Any

from ._config import GQAConfig, Inner, StrictBool, validate_config
from ._emit import Emitter, Scope, emit_decoder_model, emit_gated_mlp, emit_gqa_attention, emit_post_attn_norm
from .base import TensorInfo

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class DenseConfig(GQAConfig):
    intermediate_size: Inner
    attention_bias: StrictBool = False
    mlp_bias: StrictBool = False


def parse(raw: dict[str, Any], source: str) -> DenseConfig:
    return validate_config(DenseConfig, raw, source)


def emit(cfg: DenseConfig) -> list[TensorInfo]:
    mt = cfg.model_type
    qkv_bias = mt == "qwen2" or (mt in ("llama", "qwen3") and cfg.attention_bias)
    o_bias = mt in ("llama", "qwen3") and cfg.attention_bias
    mlp_bias = mt == "llama" and cfg.mlp_bias

    def block(e: Emitter, s: Scope, n: int) -> None:
        emit_gqa_attention(e, s, cfg, qk_norm=mt == "qwen3", qkv_bias=qkv_bias, o_bias=o_bias)
        emit_post_attn_norm(e, s, cfg.hidden_size, moe=False)
        emit_gated_mlp(e, s, hidden=cfg.hidden_size, inter=cfg.intermediate_size, bias=mlp_bias)

    return emit_decoder_model(cfg, block)


def summary(cfg: DenseConfig) -> dict[str, int]:
    return {"num_experts": 0, "num_shared_experts": 0, "first_dense_layers": 0, "num_mtp_layers": 0}
