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
# Its counterpart for a model without routed experts (every MoE recipe names routed_experts, which a dense model
# lacks, so the MoE default would not even resolve there).
DEFAULT_DENSE_POLICY = "nvfp4-dense"
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


def is_dense(arch) -> bool:
    """No routed experts: the MoE recipes do not apply."""
    return not any(t.role.startswith("routed_experts.") for t in arch.tensors)


def default_policy(arch) -> str:
    """The shipped policy `policyc run` uses when none is given: the NVFP4 per-token recipe that fits the model."""
    return DEFAULT_DENSE_POLICY if is_dense(arch) else DEFAULT_POLICY


def fitting_policies(arch) -> list[str]:
    """The shipped recipes that resolve on `arch` (import fragments without a `default`, like keep-bf16, are not
    recipes). Judged on the architecture with one routed expert per layer: a selector sees role, layer and MTP, the
    shipped name globs name no expert, so every expert resolves like expert 0 (DeepSeek-V3: 1.7k tensors instead of
    46k; tests/test_policies.py compares with full resolution)."""
    from ..diagnostics import PolicyError
    from ..lang import ast
    from ..resolve import load_policy
    from ..resources import policies_dir

    few = arch.model_copy(update={"tensors": tuple(t for t in arch.tensors if not t.expert)})
    out = []
    for path in sorted(policies_dir().glob("*.policy")):
        try:
            if not any(isinstance(st, ast.Default) for st in load_policy(path).statements):
                continue
            resolve(path, few)
        except PolicyError:
            continue
        out.append(path.stem)
    return out


def load_plan(policy: Optional[str], arch, parallel=None) -> Plan:
    """Resolve a policy (path or shipped name; None: the default that fits the model) against the architecture with
    the project's resolver. A policy that does not resolve on the model names the shipped ones that do."""
    from ..diagnostics import PolicyError

    try:
        return resolve(str(policy_path(policy or default_policy(arch))), arch, parallel)
    except PolicyError as err:
        raise err.with_note(f"shipped policies that fit {arch.name}: {', '.join(fitting_policies(arch))}")


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
