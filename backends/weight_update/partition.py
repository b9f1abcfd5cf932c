"""The rollout partition rule: which HF tensors, row / column slices and experts one SGLang rank holds.

A pure function of the plan, the model's config and the rollout layout (tp, ep); nothing here moves bytes except
`partition_tensors`, which cuts checkpoint tensors (the converter's bytes) down to one rank's partition.

SGLang 0.5.23 shards a Qwen3-MoE / Qwen3 / Llama model as follows (tp_rank r of tp ranks, moe_tp = tp // ep):

* q/k/v (`QKVParallelLinear`), dense and shared-expert gate/up (`MergedColumnParallelLinear`): column-parallel,
  each rank holds a contiguous block of OUTPUT ROWS (sglang/srt/layers/linear.py: ColumnParallelLinear.weight_loader
  narrows dim 0 at tp_rank * shard_size). KV heads: when tp > num_kv_heads each KV head is replicated on
  tp // num_kv_heads consecutive ranks (linear.py QKVParallelLinear: num_kv_head_replicas, shard_id =
  tp_rank // num_kv_head_replicas).
* o_proj, dense / shared-expert down_proj (`RowParallelLinear`): each rank holds a block of INPUT COLUMNS
  (linear.py RowParallelLinear.weight_loader narrows dim 1).
* embed_tokens (`VocabParallelEmbedding`) and lm_head (`ParallelLMHead`): rows of the vocabulary padded to a
  multiple of 64, split evenly; a rank holds the real rows inside its range (possibly none)
  (sglang/srt/layers/vocab_parallel_embedding.py: pad_vocab_size, DEFAULT_VOCAB_PADDING_SIZE = 64).
* routed experts (`FusedMoE`): split over ep first (moe_ep_rank = tp_rank // moe_tp holds the global experts
  [moe_ep_rank * E / ep, (moe_ep_rank + 1) * E / ep), layers/moe/fused_moe_triton/layer.py
  _map_global_expert_id_to_local_expert_id), then over moe_tp inside each expert (moe_tp_rank = tp_rank % moe_tp:
  w1/w3 = gate/up narrowed on output rows, w2 = down on input columns, layer.py _load_w13 / _load_w2); the rank
  order of the moe_ep / moe_tp groups is sglang/srt/distributed/parallel_state.py initialize_model_parallel.
* norms, the router (`ReplicatedLinear` in sglang/srt/models/qwen3_moe.py), q_norm / k_norm: whole on every rank.

Quantized tensors are cut along whole scale blocks: a slice whose edge falls inside a block (an NVFP4 1x16 block,
an MXFP8 1x32 block, a 128x128 FP8 block, or a packed FP4 byte) is refused with `PartitionError`, as SGLang's own
quantized loaders cannot split a block. Per-tensor and share-scale-group scales (NVFP4 weight_scale_2, input_scale)
are scalars computed by the plan's rule over the WHOLE tensor or group (q/k/v together, one expert's gate/up): every
rank holding a slice holds that same scalar, never one recomputed over its slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from precision_dsl.plan import Plan, TensorPlan

from precision_dsl.backends.weight_update.errors import WeightUpdateError

if TYPE_CHECKING:
    import torch

VOCAB_PADDING = 64  # sglang 0.5.23 layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE


class PartitionError(WeightUpdateError):
    """The rollout layout cannot hold the plan's tensors (a split that is not whole heads, experts or scale
    blocks, or a role without a partition rule)."""


@dataclass(frozen=True)
class RolloutRank:
    """One SGLang rank: tp_rank `rank` of `tp`, experts over `ep` (moe_tp = tp // ep, as SGLang derives it)."""

    tp: int
    ep: int
    rank: int

    def __post_init__(self):
        if self.tp < 1 or self.ep < 1 or not 0 <= self.rank < self.tp:
            raise PartitionError(f"rollout rank {self.rank} of tp={self.tp}, ep={self.ep} does not exist")
        if self.tp % self.ep:
            raise PartitionError(f"rollout ep={self.ep} does not divide tp={self.tp}",
                                 "SGLang derives moe_tp = tp // ep: choose ep dividing tp")

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp


@dataclass(frozen=True)
class Slice:
    """The part of one HF tensor a rank holds: whole (dim None) or [start, stop) along `dim`."""

    dim: Optional[int] = None
    start: int = 0
    stop: int = 0

    @property
    def whole(self) -> bool:
        return self.dim is None


WHOLE = Slice()


def _even(size: int, parts: int, index: int, dim: int, name: str, what: str) -> Slice:
    if size % parts:
        raise PartitionError(f"{what}={parts} does not divide dim {dim} ({size}) of '{name}'",
                             "choose a rollout layout that divides the model's widths (policyc check --parallel)")
    n = size // parts
    return Slice(dim, index * n, (index + 1) * n)


def _heads(plan_t: TensorPlan, head_dim: int, heads: int, r: RolloutRank, kv: bool) -> Slice:
    """Output rows of one of q/k/v: whole heads per rank; KV heads replicated when tp > heads (q heads never)."""
    if heads >= r.tp or not kv:
        if heads % r.tp:
            raise PartitionError(f"tp={r.tp} does not divide the {heads} heads of '{plan_t.hf_name}'",
                                 "SGLang needs whole heads per rank")
        per = heads // r.tp
        return Slice(0, r.rank * per * head_dim, (r.rank + 1) * per * head_dim)
    if r.tp % heads:
        raise PartitionError(f"tp={r.tp} is not a multiple of the {heads} KV heads of '{plan_t.hf_name}'",
                             "SGLang replicates a KV head on tp // num_kv_heads ranks")
    h = r.rank // (r.tp // heads)
    return Slice(0, h * head_dim, (h + 1) * head_dim)


def _vocab(size: int, r: RolloutRank) -> Slice:
    padded = -(-size // VOCAB_PADDING) * VOCAB_PADDING
    if padded % r.tp:
        raise PartitionError(f"tp={r.tp} does not divide the padded vocabulary ({padded})")
    per = padded // r.tp
    return Slice(0, min(r.rank * per, size), min((r.rank + 1) * per, size))


def _geometry(arch_config: dict) -> tuple[int, int, int]:
    heads = arch_config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise PartitionError("the model config has no num_attention_heads", "pass the model's config.json")
    kv = arch_config.get("num_key_value_heads") or heads
    hd = arch_config.get("head_dim") or arch_config["hidden_size"] // heads
    return heads, kv, hd


_COLUMN = {"mlp.gate", "mlp.up", "shared_experts.gate", "shared_experts.up"}
_ROW = {"attn.o", "mlp.down", "shared_experts.down"}
_WHOLE = {"norm.final", "norm.input", "norm.post_attn", "norm.q", "norm.k", "router.weight", "router.bias",
          "shared_experts.gate_weight"}


def tensor_slice(t: TensorPlan, r: RolloutRank, arch_config: dict, num_experts: int) -> Optional[Slice]:
    """What rank `r` holds of plan tensor `t`: a Slice, or None when the tensor is not on this rank (another EP
    rank's expert)."""
    role = t.role
    if role in _WHOLE:
        return WHOLE
    if role in ("embedding", "lm_head"):
        return WHOLE if r.tp == 1 else _vocab(t.shape[0], r)
    heads, kv, hd = _geometry(arch_config)
    if role == "attn.q":
        return _heads(t, hd, heads, r, kv=False)
    if role in ("attn.k", "attn.v"):
        return _heads(t, hd, kv, r, kv=True)
    if role == "bias.attn":  # q/k/v biases follow their weight's output rows
        mod = t.hf_name.rsplit(".", 2)[-2]
        return _heads(t, hd, heads if mod == "q_proj" else kv, r, kv=mod != "q_proj")
    if role == "bias.mlp":
        return WHOLE if ".down_proj." in t.hf_name else _even(t.shape[0], r.tp, r.rank, 0, t.hf_name, "tp")
    if role in _COLUMN:
        return _even(t.shape[0], r.tp, r.rank, 0, t.hf_name, "tp")
    if role in _ROW:
        return _even(t.shape[1], r.tp, r.rank, 1, t.hf_name, "tp")
    if role.startswith("routed_experts."):
        if num_experts % r.ep:
            raise PartitionError(f"ep={r.ep} does not divide the {num_experts} experts")
        per = num_experts // r.ep
        if not r.ep_rank * per <= t.expert < (r.ep_rank + 1) * per:
            return None
        if r.moe_tp == 1:
            return WHOLE
        if role == "routed_experts.down":
            return _even(t.shape[1], r.moe_tp, r.moe_tp_rank, 1, t.hf_name, "moe_tp")
        return _even(t.shape[0], r.moe_tp, r.moe_tp_rank, 0, t.hf_name, "moe_tp")
    raise PartitionError(f"no rollout partition rule for role '{role}' ('{t.hf_name}')",
                         "sharded updates cover dense / MoE attention + MLP models (no MLA or MTP yet); "
                         "use a rollout of tp=1")


def rollout_partition(plan: Plan, arch_config: dict, r: RolloutRank) -> dict[str, Slice]:
    """{hf_name: Slice} of every plan tensor rank `r` holds (experts of other EP ranks are absent)."""
    experts = {t.expert for t in plan.tensors if t.expert is not None}
    num = int(arch_config.get("num_experts") or arch_config.get("n_routed_experts") or len(experts))
    out = {}
    for t in plan.tensors:
        s = tensor_slice(t, r, arch_config, num)
        if s is not None:
            out[t.hf_name] = s
    return out


def _stored_range(t: TensorPlan, name: str, stored: tuple, s: Slice) -> tuple[int, int]:
    """[start, stop) along s.dim of one checkpoint tensor of `t` (data or block scales), refusing a cut block."""
    full = t.shape[s.dim]
    if name == t.hf_name or not t.is_linear or not t.precision.weight.is_quantized:
        unit, exact = full // stored[s.dim], True  # the data: elements per stored element (2 for packed FP4)
    else:
        unit, exact = t.precision.weight.block[s.dim], False  # a block-scale tensor
    if s.start % unit or (s.stop % unit and not (not exact and s.stop == full)):
        what = "a packed byte" if exact else f"a {'x'.join(map(str, t.precision.weight.block))} scale block"
        raise PartitionError(f"the rollout slice [{s.start}, {s.stop}) of dim {s.dim} of '{t.hf_name}' "
                             f"({t.precision.weight.short()}) splits {what} of '{name}'",
                             "quantized tensors shard along whole scale blocks: choose a rollout tp / ep whose "
                             "partitions are multiples of the block")
    return s.start // unit, -(-s.stop // unit)


def partition_specs(plan: Plan, part: dict[str, Slice]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{checkpoint name: (safetensors dtype, shape)} a rank holds: what it must receive, exactly."""
    from precision_dsl.backends.quantize import output_specs

    by = plan.by_name()
    out = {}
    for hf, s in part.items():
        t = by[hf]
        for name, dt, shape in output_specs(t):
            shape = tuple(shape)
            if not s.whole and len(shape) > s.dim:
                a, b = _stored_range(t, name, shape, s)
                shape = shape[:s.dim] + (b - a,) + shape[s.dim + 1:]
            out[name] = (dt, shape)
    return out


def partition_tensors(plan: Plan, part: dict[str, Slice], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's checkpoint tensors cut out of the full ones (`tensors`: the converter's / the update's bytes,
    by checkpoint name). Slices are contiguous copies."""
    from precision_dsl.backends.quantize import output_specs

    by = plan.by_name()
    out = {}
    for hf, s in part.items():
        t = by[hf]
        for name, _dt, shape in output_specs(t):
            x = tensors[name]
            if not s.whole and x.dim() > s.dim:
                a, b = _stored_range(t, name, tuple(shape), s)
                x = x.narrow(s.dim, a, b - a)
            out[name] = x.contiguous()
    return out
