"""The engine's seam to the resolver: policy file -> Plan for the model, plus the deliberately broken rollout plans.

`load_plan` uses `precision_dsl.resolve.resolve(policy_path, arch)`. Until the resolver is importable, a STAND-IN
builds the six seed policies (by file stem) directly from the architecture catalog; it is announced on stderr and
is removed once the resolver lands.

`broken_rollout_plan(plan, kind)` makes the rollout side disagree with the trainer in one controlled way:
  per_tensor : NVFP4 per-token activation scales -> one per-tensor scale (batch-variant, as in the blog's warning)
  unshared   : gate/up share-scale groups dropped -> each weight gets its own NVFP4 global scale
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from ..plan import Plan, ShareScaleGroup, TensorPlan
from ..precision import BackwardMode, FormatKind, Precision, TensorFormat

DEFAULT_POLICY = "nvfp4-pertoken-dequant-backward"
SEED_POLICIES = ("bf16", "mxfp8-e2e", "mxfp8-hp-backward", "mxfp8-dequant-backward",
                 "nvfp4-pertoken-hp-backward", "nvfp4-pertoken-dequant-backward")
BROKEN_KINDS = ("per_tensor", "unshared")


class PlanLoadError(ValueError):
    pass


def policy_path(policy: Optional[str]) -> Path:
    """A path, or the stem of a shipped policy (`mxfp8-e2e`), or None for the engine's default."""
    from ..resources import policies_dir

    name = policy or DEFAULT_POLICY
    p = Path(name)
    if p.suffix == ".policy" and p.exists():
        return p
    try:
        shipped = policies_dir() / (p.stem + ".policy")
    except FileNotFoundError:
        shipped = Path("policies") / (p.stem + ".policy")
    if shipped.exists() or p.stem in SEED_POLICIES:
        return shipped
    raise PlanLoadError(f"policy {name!r}: no such file and not a shipped policy (hint: one of "
                        f"{', '.join(SEED_POLICIES)} or a path to a .policy file)")


def load_plan(policy: Optional[str], arch) -> Plan:
    path = policy_path(policy)
    try:
        from ..resolve import resolve  # type: ignore[attr-defined]
    except ImportError:
        resolve = None
    if resolve is not None and path.exists():
        return resolve(str(path), arch)
    if path.stem not in SEED_POLICIES:
        raise PlanLoadError(f"{path}: the policy resolver is not available in this build")
    print(f"[policyc run] note: resolver not available; using the engine's built-in stand-in for {path.stem}",
          file=sys.stderr)
    return standin_plan(path.stem, arch)


# ---------------------------------------------------------------------------------------------------------------
# stand-in for the six seed policies (the blog's ablation; last 15% of layers BF16, router/embeddings/lm_head BF16)
# ---------------------------------------------------------------------------------------------------------------
def _mxfp8() -> TensorFormat:
    return TensorFormat(kind=FormatKind.MXFP8, element="e4m3", block=(1, 32), scale_dtype="e8m0")


def _nvfp4(scope: str) -> TensorFormat:
    return TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale=scope)


def standin_plan(stem: str, arch) -> Plan:
    bf16 = Precision.high("bf16")
    n_bf16_tail = round(arch.num_layers * 0.15 + 0.5) if stem != "bf16" else 0  # ceil-ish: >= 1 layer
    bf16_layers = set(range(arch.num_layers - n_bf16_tail, arch.num_layers))
    back = BackwardMode.DEQUANTIZED if "dequant" in stem else BackwardMode.HIGH_PRECISION
    tensors, groups = [], []
    for t in arch.tensors:
        prec = bf16
        group = None
        if t.is_linear and t.role != "lm_head" and t.layer not in bf16_layers and stem != "bf16":
            if stem.startswith("mxfp8"):
                if stem == "mxfp8-e2e":
                    prec = Precision(weight=_mxfp8(), activation=_mxfp8(), grad=_mxfp8(),
                                     backward=BackwardMode.QUANTIZED)
                else:
                    prec = Precision(weight=_mxfp8(), activation=_mxfp8(), grad=bf16.grad, backward=back)
            elif t.role.startswith("routed_experts"):
                shared = t.role in ("routed_experts.gate", "routed_experts.up")
                prec = Precision(weight=_nvfp4("group" if shared else "tensor"), activation=_nvfp4("row"),
                                 grad=bf16.grad, backward=back)
                if shared:
                    group = f"model.layers.{t.layer}.mlp.experts.{t.expert}.{{gate_proj,up_proj}}"
            else:  # attention next to NVFP4 experts: MXFP8 (as the blog's NVFP4 runs keep non-expert GEMMs 8-bit)
                prec = Precision(weight=_mxfp8(), activation=_mxfp8(), grad=bf16.grad, backward=back)
        tensors.append(TensorPlan(
            hf_name=t.hf_name, megatron_name=t.megatron_name, megatron_part=t.megatron_part,
            sglang_prefix=t.sglang_prefix, role=t.role, layer=t.layer, expert=t.expert, mtp=t.mtp, shape=t.shape,
            is_linear=t.is_linear, precision=prec, share_scale_group=group, bytes_before=2 * t.numel,
            bytes_after=int(t.numel * prec.weight.bits / 8)))
        if group and t.role == "routed_experts.gate":
            groups.append(ShareScaleGroup(id=group, members=(t.hf_name, t.hf_name.replace("gate_proj", "up_proj"))))
    return Plan(policy_name=stem, policy_files=(f"<standin:{stem}>",), model=arch.name, model_type=arch.model_type,
                num_layers=arch.num_layers, target="hopper", emulate=True, tensors=tuple(tensors),
                share_scale_groups=tuple(groups), notes=("engine stand-in plan (resolver not available)",))


# ---------------------------------------------------------------------------------------------------------------
def broken_rollout_plan(plan: Plan, kind: str) -> Plan:
    if kind not in BROKEN_KINDS:
        raise PlanLoadError(f"--broken-contract must be one of {', '.join(BROKEN_KINDS)}, got {kind!r}")
    if kind == "per_tensor":
        changed = []
        n = 0
        for t in plan.tensors:
            a = t.precision.activation
            if t.is_linear and a.kind == FormatKind.NVFP4 and a.global_scale == "row":
                p = t.precision.model_copy(update={"activation": a.model_copy(update={"global_scale": "tensor"})})
                t = t.model_copy(update={"precision": p})
                n += 1
            changed.append(t)
        if n == 0:
            raise PlanLoadError(f"--broken-contract per_tensor: policy {plan.policy_name!r} has no per-token NVFP4 "
                                "activations to break (hint: use an nvfp4-pertoken policy)")
        return plan.model_copy(update={"tensors": tuple(changed), "notes": plan.notes + (
            "BROKEN CONTRACT: rollout uses per-tensor NVFP4 activation scales",)})
    if not plan.share_scale_groups:
        raise PlanLoadError(f"--broken-contract unshared: policy {plan.policy_name!r} declares no share-scale groups "
                            "(hint: use an nvfp4 policy with gate/up sharing)")
    changed = []
    for t in plan.tensors:
        if t.share_scale_group is not None:
            w = t.precision.weight
            p = t.precision.model_copy(update={"weight": w.model_copy(update={"global_scale": "tensor"})})
            t = t.model_copy(update={"precision": p, "share_scale_group": None})
        changed.append(t)
    return plan.model_copy(update={"tensors": tuple(changed), "share_scale_groups": (), "notes": plan.notes + (
        "BROKEN CONTRACT: rollout gate/up weights quantized with separate NVFP4 global scales",)})
