"""The engine's seam to the resolver: policy file -> Plan for the model, plus the deliberately broken rollout plans.

`load_plan` uses `precision_dsl.resolve.resolve(policy_path, arch)` on a path or a shipped policy name.

`broken_rollout_plan(plan, kind)` makes the rollout side disagree with the trainer in one controlled way:
  per_tensor : NVFP4 per-token activation scales -> one per-tensor scale (batch-variant, as in the blog's warning)
  unshared   : gate/up share-scale groups dropped -> each weight gets its own NVFP4 global scale
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..plan import Plan
from ..precision import Scope, is_per_token
from ..resolve import resolve
from ..resources import find_policy, policy_hint
from ..errors import PolicycError

DEFAULT_POLICY = "nvfp4-pertoken-dequant-backward"
SEED_POLICIES = ("bf16", "mxfp8-e2e", "mxfp8-hp-backward", "mxfp8-dequant-backward",
                 "nvfp4-pertoken-hp-backward", "nvfp4-pertoken-dequant-backward")
BROKEN_KINDS = ("per_tensor", "unshared")


class PlanLoadError(PolicycError, ValueError):
    pass


def policy_path(policy: Optional[str]) -> Path:
    """A policy file or a shipped policy name (resources.find_policy), or None for the engine's default."""
    name = policy or DEFAULT_POLICY
    path = find_policy(name)
    if path is None:
        raise PlanLoadError(f"policy {name!r}: no such file and not a shipped policy (hint: {policy_hint()})")
    return path


def load_plan(policy: Optional[str], arch, parallel=None) -> Plan:
    """Resolve a policy (path or shipped name) against the architecture with the project's resolver."""
    return resolve(str(policy_path(policy)), arch, parallel)


# ---------------------------------------------------------------------------------------------------------------
def broken_rollout_plan(plan: Plan, kind: str) -> Plan:
    if kind not in BROKEN_KINDS:
        raise PlanLoadError(f"--broken-contract must be one of {', '.join(BROKEN_KINDS)}, got {kind!r}")
    if kind == "per_tensor":
        changed = []
        n = 0
        for t in plan.tensors:
            a = t.precision.activation
            if t.is_linear and is_per_token(a):  # per-token NVFP4 activations
                p = t.precision.model_copy(update={"activation": a.model_copy(update={"global_scale": Scope.TENSOR})})
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
