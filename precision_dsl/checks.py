"""Static checks of a resolved plan against the model and (optionally) the parallel layout.

`check(plan, arch, parallel=None) -> list[Diagnostic]`. Policy-level mistakes are raised by `resolve` as PolicyError;
these checks find what depends on the model's shapes and on how trainer (Megatron) and rollout (SGLang) shard it:

  block-divisibility  every quantized dim divides into its blocks, for the whole tensor and for every TP shard
  fused-siblings      q/k/v, gate/up, q_a/kv_a of one instance get one format (serving engines fuse them)
  share-scale-missing (warning) fused siblings with per-tensor second-level scales that do not share them
  share-scale         members of a share-scale group get one format and carry weight global_scale='group'
  hardware            MXFP8 / NVFP4 only on Blackwell unless the policy says `target hopper emulate`
  rollout-etp         the rollout etp is what SGLang derives from the launch args (moe_tp = tp / ep); another is
                      a contract SGLang never sees
  etp-mismatch        per-token (row) activation scales on routed experts need trainer.etp == rollout.etp
  layout-trainer / layout-rollout  the layout breaks a divisibility rule Megatron / SGLang enforce when they build
                      the model (heads, KV heads, experts, FFN widths, layers per stage: precision_dsl/parallel.py)
  (pipeline splits and BF16 layer runs are the Megatron emitter's business: it lays out uneven splits with
  --decoder-first/last-pipeline-num-layers and refuses, by name, what one TE precision file cannot express; the
  check/emit gate, precision_dsl/engine/gate.py, reports those refusals as errors of `policyc check`)
  scale-scope         weight_scale=per_expert on a tensor that is not a routed expert (warning)

Findings about many tensors with the same cause (e.g. 256 experts x 58 layers) are reported once, naming the first
tensor and how many more share the problem.

Layout facts used (HF weight layout [N, K] = [out_features, in_features]):
  * rowwise blocks run along K (the contraction dim); MXFP8 training also keeps a columnwise copy, blocked along N
    (TE MXFP8Quantizer needs last dim % 32 and prod(leading dims) % 32);
  * NVFP4 needs K % 16 (and N % 16 for 16x16 weight blocks); FP8-block tolerates partial blocks in a whole tensor
    but a TP shard boundary must not cut a 128-block (SGLang: "weight_block_size must divide the partition");
  * column-parallel layers (q/k/v/q_b/kv_b, gate/up, lm_head) split N by tp; row-parallel (o, down) split K by tp;
    routed experts use the expert-TP size etp. q_a/kv_a and MTP eh_proj are replicated.
"""

from __future__ import annotations

from typing import Optional

from .arch.base import Architecture
from .diagnostics import Diagnostic
from .parallel import layout_violations
from .plan import ParallelLayout, ParallelSide, Plan, TensorPlan, per_precision
from .precision import BLACKWELL_ONLY_KINDS, FormatKind, Scope, TensorFormat, is_per_token

COLUMN_PARALLEL = frozenset({
    "attn.q", "attn.k", "attn.v", "attn.q_b", "attn.kv_b", "mlp.gate", "mlp.up", "shared_experts.gate",
    "shared_experts.up", "routed_experts.gate", "routed_experts.up", "lm_head", "mtp.lm_head",
})
ROW_PARALLEL = frozenset({"attn.o", "mlp.down", "shared_experts.down", "routed_experts.down"})


def check(plan: Plan, arch: Architecture, parallel: Optional[ParallelLayout] = None) -> list[Diagnostic]:
    parallel = parallel if parallel is not None else plan.parallel
    diags: list[Diagnostic] = []
    diags += check_hardware(plan)
    diags += check_block_divisibility(plan, arch, parallel)
    diags += check_fused_siblings(plan)
    diags += check_share_scale(plan)
    diags += check_scale_scope(plan)
    if parallel is not None:
        diags += check_rollout_etp(plan, parallel)
        diags += check_etp(plan, parallel)
        diags += [Diagnostic(severity="error", code=f"layout-{v.side}", message=f"{v.rule}: {v.message}", hint=v.hint)
                  for v in layout_violations(arch, parallel)]  # what Megatron / SGLang refuse at start-up
    return diags


# ---- helpers -------------------------------------------------------------------------------------------------------
class _Aggregator:
    """Collect (key -> tensors) and emit one Diagnostic per key naming the first tensor and the count of others."""

    def __init__(self):
        self.items: dict[tuple, list[str]] = {}
        self.meta: dict[tuple, tuple[str, str, str, str]] = {}

    def add(self, key: tuple, tensor: str, severity: str, code: str, message: str, hint: str) -> None:
        self.items.setdefault(key, []).append(tensor)
        self.meta.setdefault(key, (severity, code, message, hint))

    def diagnostics(self) -> list[Diagnostic]:
        out = []
        for key, names in self.items.items():
            severity, code, message, hint = self.meta[key]
            more = ""
            if len(names) > 1:
                more = f" (and {len(names) - 1} more tensor{'s' if len(names) > 2 else ''} like it)"
            out.append(Diagnostic(severity=severity, code=code, message=f"{names[0]}: {message}{more}", hint=hint,
                                  tensor=names[0]))  # type: ignore[arg-type]
        return out


def _matrix(shape: tuple[int, ...]) -> Optional[tuple[int, int]]:
    if len(shape) < 2:
        return None
    k = shape[-1]
    n = 1
    for d in shape[:-1]:
        n *= d
    return n, k


def _dim_problems(n: int, k: int, w: TensorFormat, a: TensorFormat, g: TensorFormat, quantized_bwd: bool,
                  shard_axis: Optional[str] = None) -> list[str]:
    """Problems of one [n, k] weight (a whole tensor or one shard). `shard_axis` (N|K) marks a TP-split dim,
    where FP8-block tiles must not be cut."""
    rule = _WEIGHT_DIM_RULES.get(w.kind)
    probs = rule(n, k, w, shard_axis) if rule is not None else []
    # activations share K with the weight: only report when the weight did not already (weight-hp, act-quantized)
    if a.kind != w.kind and a.spec.whole_blocks and a.block and k % a.block[1]:
        probs.append(f"activation K={k} is not a multiple of {a.block[1]} ({a.kind.value} activation blocks)")
    # quantized output gradients [M, N] are blocked along N: covered by the MXFP8 weight's N % 32 rule above
    if quantized_bwd and g.kind != w.kind and g.spec.whole_blocks and g.block and n % g.block[1]:
        probs.append(f"gradient N={n} is not a multiple of {g.block[1]} (MXFP8 output-gradient blocks)")
    return sorted(set(probs))


def _mxfp8_weight_dims(n: int, k: int, w: TensorFormat, shard_axis: Optional[str]) -> list[str]:
    probs = []
    if k % 32:
        probs.append(f"K={k} is not a multiple of 32 (MXFP8 rowwise 1x32 blocks)")
    if n % 32:
        probs.append(f"N={n} is not a multiple of 32 (MXFP8 columnwise copy for training / 32x32 blocks)")
    return probs


def _nvfp4_weight_dims(n: int, k: int, w: TensorFormat, shard_axis: Optional[str]) -> list[str]:
    probs = []
    if k % 16:
        probs.append(f"K={k} is not a multiple of 16 (NVFP4 1x16 blocks)")
    if w.block and w.block[0] == 16 and n % 16:
        probs.append(f"N={n} is not a multiple of 16 (NVFP4 16x16 weight blocks)")
    return probs


def _fp8_block_weight_dims(n: int, k: int, w: TensorFormat, shard_axis: Optional[str]) -> list[str]:
    probs = []
    br, bc = w.block or (128, 128)
    if shard_axis == "N" and n % br:
        probs.append(f"shard N={n} cuts a {br}-row FP8 block (shard boundaries must align to blocks)")
    if shard_axis == "K" and k % bc:
        probs.append(f"shard K={k} cuts a {bc}-column FP8 block (shard boundaries must align to blocks)")
    return probs


# The dimension rules of a quantized weight [n, k] (or one TP shard of it), by kind.
_WEIGHT_DIM_RULES = {
    FormatKind.MXFP8: _mxfp8_weight_dims,
    FormatKind.NVFP4: _nvfp4_weight_dims,
    FormatKind.FP8_BLOCK: _fp8_block_weight_dims,
}


def _shard(t: TensorPlan, side: ParallelSide, arch: Architecture) -> Optional[tuple[int, str]]:
    """(split factor, axis) of this tensor on one side, or None when it is not split."""
    if t.role in ("attn.k", "attn.v"):
        kv_heads = int(arch.config.get("num_key_value_heads") or arch.config.get("num_attention_heads") or side.tp)
        f = min(side.tp, kv_heads)  # engines replicate KV heads beyond tp == num_kv_heads
        return (f, "N") if f > 1 else None
    tp = side.etp if t.role.startswith("routed_experts.") else side.tp
    if tp <= 1:
        return None
    if t.role in COLUMN_PARALLEL:
        return tp, "N"
    if t.role in ROW_PARALLEL:
        return tp, "K"
    return None


# ---- checks --------------------------------------------------------------------------------------------------------
def check_block_divisibility(plan: Plan, arch: Architecture, parallel: Optional[ParallelLayout]) -> list[Diagnostic]:
    agg = _Aggregator()
    sides = [] if parallel is None else [("trainer", parallel.trainer), ("rollout", parallel.rollout)]
    cache: dict = {}
    for t in plan.tensors:
        if not t.is_linear or not t.precision.is_quantized:
            continue
        nk = _matrix(t.shape)
        if nk is None:
            continue
        p = t.precision
        qbwd = p.backward.value == "quantized"
        key = (t.role, nk, id(p))
        if key not in cache:
            found = []
            for prob in _dim_problems(nk[0], nk[1], p.weight, p.activation, p.grad, qbwd):
                found.append((prob, ""))
            for side_name, side in sides:
                sh = _shard(t, side, arch)
                if sh is None:
                    continue
                f, axis = sh
                n, k = nk
                size = n if axis == "N" else k
                if size % f:
                    found.append((f"{axis}={size} does not split evenly over {side_name} "
                                  f"{'etp' if t.role.startswith('routed_experts.') else 'tp'}={f}", side_name))
                    continue
                sn, sk = (n // f, k) if axis == "N" else (n, k // f)
                for prob in _dim_problems(sn, sk, p.weight, p.activation, p.grad, qbwd, shard_axis=axis):
                    found.append((f"{prob} in each {side_name} shard [{sn}, {sk}] "
                                  f"({'etp' if t.role.startswith('routed_experts.') else 'tp'}={f})", side_name))
            cache[key] = found
        for prob, side_name in cache[key]:
            hint = ("keep this tensor in bf16 (add a rule), choose a format whose block divides the dims"
                    if not side_name else f"change the {side_name} tensor-parallel size, or keep the tensor in bf16")
            agg.add(("blocks", t.role, nk, id(p), prob), t.hf_name, "error", "block-divisibility",
                    f"{p.weight.short()} on shape {list(t.shape)}: {prob}", hint)
    return agg.diagnostics()


def check_fused_siblings(plan: Plan) -> list[Diagnostic]:
    """Siblings that engines fuse into one GEMM must agree in format (weight kind/block, activation, backward).
    The weight's second-level scale scope may differ only by share_scale ('group' vs per tensor) handled in
    check_share_scale, so it is ignored here."""
    agg = _Aggregator()
    fusion_key = per_precision(_fusion_key)
    for (g, _mtp, _layer, _expert), members in plan.fused_members().items():
        w = members[0].weight
        if len(members) > 1 and w.is_quantized and all(m.weight.global_scale in ("tensor", "expert") for m in members):
            # engines fuse these into one GEMM with ONE second-level scale and reconcile separate scales with max()
            # (vLLM #47515, #55073): the plan should say the scale is shared
            agg.add(("unshared", g, w.kind), members[0].hf_name, "warning", "share-scale-missing",
                    f"{w.kind.value} weight with a per-tensor second-level scale, but its fused {g} siblings do not "
                    "share it; serving engines fuse them into one GEMM with one scale",
                    f"declare `share_scale` over the siblings, e.g. `share_scale {_share_example(g)}`")
        a = members[0]
        if any(fusion_key(m) != fusion_key(a) for m in members[1:]):  # tuples compare shared objects by identity
            b = next(m for m in members if fusion_key(m) != fusion_key(a))
            agg.add(("fused", g, a.role, b.role, a.precision.short(), b.precision.short()), a.hf_name, "error",
                    "fused-siblings",
                    f"is {a.precision.short()} but its fused sibling {b.hf_name} is {b.precision.short()}; "
                    f"serving engines run the {g} siblings as one GEMM",
                    "give the siblings one rule, e.g. `routed_experts.{gate, up}: ...` or `attn.{q, k, v}: ...`")
    return agg.diagnostics()


def _share_example(group: str) -> str:
    return {"qkv": "attn.{q, k, v}", "q_a+kv_a": "attn.{q_a, kv_a}", "gate_up": "mlp.{gate, up}",
            "experts.gate_up": "routed_experts.{gate, up}",
            "shared_experts.gate_up": "shared_experts.{gate, up}"}.get(group, "<siblings>")


def _fusion_key(t: TensorPlan):
    p = t.precision
    w = p.weight
    return (w.kind, w.element, w.block, w.scale_dtype, p.activation, p.grad, p.backward)


def check_share_scale(plan: Plan) -> list[Diagnostic]:
    by_name = {t.hf_name: t for t in plan.tensors} if plan.share_scale_groups else {}
    out = []
    for g in plan.share_scale_groups:
        members = [by_name.get(m) for m in g.members]
        missing = [m for m, t in zip(g.members, members) if t is None]
        if missing:
            out.append(Diagnostic(severity="error", code="share-scale", tensor=missing[0],
                                  message=f"{missing[0]}: member of share-scale group {g.id} is not in the plan",
                                  hint="re-resolve the plan against this model"))
            continue
        first = members[0].precision if members else None
        if any(t.precision is not first and t.precision != first for t in members):  # identity first: no hashing
            a, b = members[0], next(t for t in members if t.precision != members[0].precision)
            out.append(Diagnostic(severity="error", code="share-scale", tensor=a.hf_name,
                                  message=f"{a.hf_name} is {a.precision.short()} but {b.hf_name} in the same share-"
                                  f"scale group {g.id} is {b.precision.short()}",
                                  hint="one shared scale needs one format: give the members the same rule"))
        elif members and members[0].weight.is_quantized and members[0].weight.global_scale != "group":
            out.append(Diagnostic(severity="error", code="share-scale", tensor=members[0].hf_name,
                                  message=f"{members[0].hf_name}: share-scale group {g.id} but the weight format "
                                  f"{members[0].weight.short()} does not use a group scale",
                                  hint="re-resolve the plan with policyc (the resolver sets global_scale='group')"))
    return out


def check_hardware(plan: Plan) -> list[Diagnostic]:
    if plan.target != "hopper" or plan.emulate:
        return []
    agg = _Aggregator()
    for t in plan.tensors:
        if not t.is_linear:
            continue
        kinds = {t.weight.kind, t.activation.kind, t.grad.kind} & BLACKWELL_ONLY_KINDS
        for k in sorted(kinds, key=lambda x: x.value):
            agg.add(("hw", k), t.hf_name, "error", "hardware",
                    f"{k.value} GEMMs run natively only on Blackwell, but the plan targets hopper",
                    "use `target blackwell`, `target hopper emulate` (exact emulation, no speed-up), or fp8 / "
                    "fp8_block on Hopper")
    return agg.diagnostics()


def check_scale_scope(plan: Plan) -> list[Diagnostic]:
    agg = _Aggregator()
    for t in plan.tensors:
        if t.is_linear and t.weight.is_quantized and t.weight.global_scale == Scope.EXPERT and \
                not t.role.startswith("routed_experts."):
            agg.add(("scope",), t.hf_name, "warning", "scale-scope",
                    "weight_scale=per_expert on a tensor that is not a routed expert; it means per tensor here",
                    "use weight_scale=per_tensor outside routed experts")
    return agg.diagnostics()


def check_rollout_etp(plan: Plan, parallel: ParallelLayout) -> list[Diagnostic]:
    """SGLang 0.5.23 has no expert-TP flag: moe_tp_size = tp_size // ep_size // moe_dp_size (runtime_context.py
    `derive_parallel_widths`), and it requires tp_size % ep_size == 0."""
    ro = parallel.rollout
    first = next((t.hf_name for t in plan.tensors if t.role.startswith("routed_experts.")), None)
    if first is None:
        return []
    if ro.tp % ro.ep:
        return [Diagnostic(severity="error", code="rollout-etp", tensor=first,
                           message=f"rollout ep={ro.ep} does not divide rollout tp={ro.tp}; SGLang requires "
                                   "tp_size % ep_size == 0",
                           hint="choose a rollout ep that divides tp")]
    derived = ro.tp // ro.ep
    if ro.etp == derived:
        return []
    return [Diagnostic(severity="error", code="rollout-etp", tensor=first,
                       message=f"rollout etp={ro.etp}, but SGLang derives expert TP from its launch args: moe_tp = "
                               f"tp/ep = {ro.tp}/{ro.ep} = {derived} (there is no expert-TP flag)",
                       hint=f"write rollout:tp={ro.tp},ep={ro.ep} (etp {derived}), or change the rollout tp/ep")]


def check_etp(plan: Plan, parallel: ParallelLayout) -> list[Diagnostic]:
    tr, ro = parallel.trainer.etp, parallel.rollout.etp
    if tr == ro:
        return []
    agg = _Aggregator()
    for t in plan.tensors:
        if t.role.startswith("routed_experts.") and t.activation.is_quantized and is_per_token(t.activation):
            agg.add(("etp",), t.hf_name, "error", "etp-mismatch",
                    f"per-token activation scales on routed experts need the same expert-TP size in trainer and "
                    f"rollout, but trainer etp={tr} and rollout etp={ro}",
                    "set equal expert tensor-parallel sizes (Megatron --expert-tensor-parallel-size, SGLang "
                    "moe_tp_size = tp / ep / moe_dp), or use act_scale=per_tensor")
    return agg.diagnostics()
