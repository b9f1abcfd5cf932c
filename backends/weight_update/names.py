"""Megatron -> HF names: a trainer's full (TP-gathered) Megatron weights split into the plan's HF tensors, and per-rank
TP/EP shards gathered into full weights."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from precision_dsl.plan import Plan, TensorPlan

from precision_dsl.backends.weight_update.errors import WeightUpdateError

if TYPE_CHECKING:
    import torch


def _qkv_geometry(plan: Plan, layer_key: tuple, arch_config: Optional[dict]) -> tuple[int, int, int]:
    """(num_query_groups, q_heads_per_group, head_dim) for one layer's linear_qkv."""
    q = k = qn = None
    for t in plan.tensors:
        if (t.mtp, t.layer) != layer_key:
            continue
        if t.role == "attn.q":
            q = t
        elif t.role == "attn.k":
            k = t
        elif t.role == "norm.q":
            qn = t
    hd = None
    if arch_config:
        hd = arch_config.get("head_dim") or (arch_config["hidden_size"] // arch_config["num_attention_heads"]
                                             if "num_attention_heads" in arch_config else None)
    if hd is None and qn is not None:
        hd = qn.shape[0]
    if hd is None or q is None or k is None:
        raise WeightUpdateError(f"cannot split linear_qkv of layer {layer_key}: head_dim unknown",
                                "pass arch_config=<config.json dict> to WeightSender")
    ng = k.shape[0] // hd
    return ng, q.shape[0] // hd // ng, hd


class _NameMap:
    def __init__(self, plan: Plan, arch_config: Optional[dict] = None):
        self.plan = plan
        self.arch_config = arch_config
        self.hf = plan.by_name()
        self.meg: dict[str, list[TensorPlan]] = {}
        for t in plan.tensors:
            if t.megatron_name:
                self.meg.setdefault(t.megatron_name, []).append(t)

    def to_hf(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name in self.hf:
            return [(name, x)]
        ts = self.meg.get(name)
        if not ts:
            raise WeightUpdateError(f"weight '{name}' is neither an HF nor a Megatron name of the plan's model "
                                    f"'{self.plan.model}'", "is the trainer running the model the plan was made for?")
        if len(ts) == 1 and ts[0].megatron_part is None:
            return [(ts[0].hf_name, x)]
        parts = {t.megatron_part: t for t in ts}
        if set(parts) == {"gate", "up"}:
            g, u = x.chunk(2, dim=0)  # fc1 = cat([gate, up], 0) (Megatron-Bridge GatedMLPMapping)
            return [(parts["gate"].hf_name, g), (parts["up"].hf_name, u)]
        if set(parts) == {"q", "k", "v"}:
            ng, qpg, hd = _qkv_geometry(self.plan, (ts[0].mtp, ts[0].layer), self.arch_config)
            hidden = x.shape[-1]
            # grouped per KV head: [ng, (qpg + 2) * hd, hidden], split [qpg, 1, 1] heads (Bridge QKVMapping)
            v3 = x.reshape(ng, qpg + 2, hd, hidden)
            q = v3[:, :qpg].reshape(ng * qpg * hd, hidden)
            k = v3[:, qpg].reshape(ng * hd, hidden)
            v = v3[:, qpg + 1].reshape(ng * hd, hidden)
            return [(parts["q"].hf_name, q), (parts["k"].hf_name, k), (parts["v"].hf_name, v)]
        raise WeightUpdateError(f"no split rule for Megatron weight '{name}' (parts {sorted(map(str, parts))})")


def megatron_to_hf(plan: Plan, name: str, x: torch.Tensor, arch_config: Optional[dict] = None):
    """HF (name, tensor) pairs of one full Megatron (or HF) weight."""
    return _NameMap(plan, arch_config).to_hf(name, x)


@dataclass
class RankShard:
    """One trainer rank's local state dict and its coordinates (Megatron parallel state)."""

    tp_rank: int
    state: dict[str, torch.Tensor]
    ep_rank: int = 0
    etp_rank: int = 0


_ROW_PARALLEL_RE = re.compile(r"\.(linear_proj|linear_fc2)\.weight\d*$")
_COLUMN_PARALLEL_RE = re.compile(r"\.(linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|"
                                 r"eh_proj)\.weight\d*$|^(embedding\.word_embeddings|output_layer)\.weight$")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def gather_megatron_shards(shards: Sequence[RankShard], tp: int = 1, ep: int = 1,
                           etp: int = 1) -> dict[str, torch.Tensor]:
    """Full Megatron weights (global expert indices) from per-rank TP/EP shards.

    * column-parallel (linear_qkv, linear_fc1, q/kv up-projections, embeddings, output_layer): concat on dim 0;
      linear_fc1 shards are [gate_i; up_i] each, so the full tensor is [gate_0..gate_n; up_0..up_n];
      linear_qkv shards hold whole KV groups, so a plain concat keeps the per-KV-head grouping;
    * row-parallel (linear_proj, linear_fc2): concat on dim 1;
    * expert weights: split over expert-TP (etp ranks), local index k on EP rank r is global r * E_local + k;
    * everything else (norms, router, MLA down-projections, which megatron-core keeps duplicated): replicated,
      checked equal across ranks."""
    import torch

    experts_local = None
    by_coord: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for s in shards:
        by_coord[(s.tp_rank, s.ep_rank, s.etp_rank)] = s.state
        for n in s.state:
            m = _EXPERT_RE.match(n)
            if m:
                experts_local = max(experts_local or 0, int(m.group(2)) + 1)
    out: dict[str, torch.Tensor] = {}
    names = sorted({n for s in shards for n in s.state})
    for n in names:
        m = _EXPERT_RE.match(n)
        if m:
            base, local = m.group(1), int(m.group(2))
            for er in range(ep):
                pieces_by_etp = {c[2]: by_coord[c][n] for c in sorted(by_coord) if c[1] == er and n in by_coord[c]}
                pieces = [pieces_by_etp[i] for i in range(etp)]
                out[f"{base}{er * experts_local + local}"] = _cat(n, pieces)
            continue
        pieces_by_tp = {}
        for c in sorted(by_coord):
            if n in by_coord[c]:
                pieces_by_tp.setdefault(c[0], by_coord[c][n])
        pieces = [pieces_by_tp[i] for i in range(tp)] if len(pieces_by_tp) == tp else list(pieces_by_tp.values())
        if tp > 1 and (_COLUMN_PARALLEL_RE.search(n) or _ROW_PARALLEL_RE.search(n)):
            out[n] = _cat(n, pieces)
        else:
            for p in pieces[1:]:
                if not torch.equal(p, pieces[0]):
                    raise WeightUpdateError(f"replicated weight '{n}' differs across TP ranks")
            out[n] = pieces[0]
    return out


def _cat(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    import torch

    if len(pieces) == 1:
        return pieces[0]
    if _ROW_PARALLEL_RE.search(name):
        return torch.cat(pieces, dim=1)
    if ".linear_fc1." in name:
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=0)
