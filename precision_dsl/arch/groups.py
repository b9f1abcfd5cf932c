"""Pure grouping helpers over an Architecture, for the resolver and the backends.

* fused_groups: the sibling sets that must share one format (FUSED_SIBLINGS instances: q/k/v of one layer, gate/up
  of one expert, MLA q_a + kv_a of one layer, ...), keyed by (layer, expert, mtp, group name).
* sglang_modules: tensors per SGLang module prefix. This is the granularity a serving config can express: a
  FusedMoE prefix (`model.layers.N.mlp.experts`) covers every routed expert of the layer, so per-expert precision
  differences cannot be served (SGLang 0.5.23 `is_layer_skipped`, backends.md §C.3).
* megatron_params: tensors per Megatron parameter (q/k/v -> one linear_qkv.weight; gate/up -> one linear_fc1).
"""

from __future__ import annotations

from typing import Optional

from .base import Architecture, TensorInfo

GroupKey = tuple[Optional[int], Optional[int], Optional[int], str]  # (layer, expert, mtp, fused group name)


def fused_groups(arch: Architecture) -> dict[GroupKey, list[TensorInfo]]:
    out: dict[GroupKey, list[TensorInfo]] = {}
    for t in arch.tensors:
        if t.fused_group:
            out.setdefault((t.layer, t.expert, t.mtp, t.fused_group), []).append(t)
    return out


def sglang_modules(arch: Architecture) -> dict[str, list[TensorInfo]]:
    out: dict[str, list[TensorInfo]] = {}
    for t in arch.tensors:
        if t.sglang_prefix:
            out.setdefault(t.sglang_prefix, []).append(t)
    return out


def megatron_params(arch: Architecture) -> dict[str, list[TensorInfo]]:
    out: dict[str, list[TensorInfo]] = {}
    for t in arch.tensors:
        if t.megatron_name:
            out.setdefault(t.megatron_name, []).append(t)
    return out
