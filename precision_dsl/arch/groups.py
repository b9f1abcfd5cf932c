"""Pure grouping helpers over an Architecture, for the resolver and the backends.

* fused_groups: the sibling sets that must share one format (FUSED_SIBLINGS instances: q/k/v of one layer, gate/up
  of one expert, MLA q_a + kv_a of one layer, ...), keyed by (layer, expert, mtp, group name).
* sglang_modules: tensors per SGLang module prefix. This is the granularity a serving config can express: a
  FusedMoE prefix (`model.layers.N.mlp.experts`) covers every routed expert of the layer, so per-expert precision
  differences cannot be served (SGLang 0.5.23 `python/sglang/srt/layers/quantization/utils.py`
  `is_layer_skipped`).
* megatron_params: tensors per Megatron parameter (q/k/v -> one linear_qkv.weight; gate/up -> one linear_fc1).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .base import Architecture, TensorInfo

GroupKey = tuple[Optional[int], Optional[int], Optional[int], str]  # (layer, expert, mtp, fused group name)


def _group_by(arch: Architecture, key: Callable[[TensorInfo], Any]) -> dict[Any, list[TensorInfo]]:
    """Tensors per key in catalog order; tensors whose key is None (or empty) belong to no group."""
    out: dict[Any, list[TensorInfo]] = {}
    for t in arch.tensors:
        k = key(t)
        if k:
            out.setdefault(k, []).append(t)
    return out


def fused_groups(arch: Architecture) -> dict[GroupKey, list[TensorInfo]]:
    return _group_by(arch, lambda t: (t.layer, t.expert, t.mtp, t.fused_group) if t.fused_group else None)


def sglang_modules(arch: Architecture) -> dict[str, list[TensorInfo]]:
    return _group_by(arch, lambda t: t.sglang_prefix)


def megatron_params(arch: Architecture) -> dict[str, list[TensorInfo]]:
    return _group_by(arch, lambda t: t.megatron_name)
