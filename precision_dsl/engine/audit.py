"""`policyc audit`: read an existing deployment back into two per-tensor plans - what the trainer computes and what
the rollout loads and computes - and say where they disagree, and why.

The readings are the backends' own (`megatron.trainer_tensors`, `sglang.rollout_tensors`, `vllm.serve_tensors`:
the code `derive_formats` checks emitted artifacts with), fed with hand-written inputs (engine/audit_inputs.py).
Each side's per-tensor formats are written as a policy (default bf16, one rule per role and run of layers, the
share_scale groups the engine's fused global scales imply) and resolved like any policy: the two plans are ordinary
Plan IR, `--policy-out` writes the trainer's (= the agreed one when they agree), and a deployment `policyc emit`
wrote reads back to the emitted plan's content hash.

Compared per linear tensor both sides run: the weight format and the activation (GEMM input) format. Backward
modes and gradients exist on the trainer only.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..format_specs import PER_TOKEN
from ..names import collapse_names
from .audit_inputs import AuditError, Deployment, read_deployment


@dataclass(frozen=True)
class Operand:
    """One side's GEMM of one tensor, as a policy spec: the format call (or None for bf16) + `shared`."""

    spec: Optional[str]  # policy format text, e.g. `nvfp4(act_scale=per_token, weight_scale=per_tensor)`
    shared: bool  # the weight shares one global scale with its fused siblings (share_scale)
    why: tuple[str, ...]


@dataclass
class Disagreement:
    tensors: list[str]
    trainer: str  # weight / activation, as `policyc plan` prints them
    rollout: str
    cause: str


@dataclass
class AuditResult:
    read_as: list[tuple[str, str]]
    trainer_policy: Optional[str]
    rollout_policy: Optional[str]
    trainer: Optional[object]  # Plan
    rollout: Optional[object]  # Plan
    disagreements: list[Disagreement] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return not self.disagreements


# ---------------------------------------------------------------------------------------------------------------
# readings -> format specs (the policy language's own spelling, so the resolver builds the exact formats)
# ---------------------------------------------------------------------------------------------------------------
def _nvfp4_call(act_scope: Optional[str], block, act: bool = True) -> str:
    args = []
    if act:
        args.append(f"act_scale={'per_token' if act_scope == PER_TOKEN else 'per_tensor'}")
    args.append("weight_scale=per_tensor")
    if tuple(block or (1, 16)) == (16, 16):
        args.append("weight_block=16x16")
    return f"nvfp4({', '.join(args)})"


def trainer_operand(r) -> Operand:
    """megatron.TrainerTensor -> Operand (a TE recipe quantizes weight and activation with one format)."""
    if r.kind in ("bf16", "fp16", "fp32"):
        return Operand(None if r.kind == "bf16" else r.kind, False, r.why)
    if r.kind == "nvfp4":
        call = _nvfp4_call(r.act_scope, r.weight_block)
    elif r.kind == "mxfp8":
        call = "mxfp8(grad_elem=e5m2)" if r.fp8_format == "hybrid" and r.backward == "quantized" else "mxfp8"
    elif r.kind == "fp8_block":
        call = f"fp8_block(scales={r.scale_dtype or 'pow2'})"
    else:
        call = "fp8(hybrid)" if r.fp8_format == "hybrid" else "fp8"
    return Operand(f"{call} backward={r.backward}", r.shared, r.why)


def rollout_operand(r) -> Operand:
    """sglang.RolloutTensor / vllm serving reading -> Operand (an inference engine has no backward)."""
    if r.kind in ("bf16", "fp16", "fp32"):
        return Operand(None if r.kind == "bf16" else r.kind, False, r.why)
    if r.kind == "nvfp4":
        return Operand(_nvfp4_call(r.act_scope, r.block, act=r.act_scope is not None)
                       + ("" if r.act_scope is not None else ", act=bf16"), r.shared, r.why)
    if r.kind == "mxfp8":
        return Operand("mxfp8", False, r.why)
    if r.kind == "fp8_block":
        return Operand(f"fp8_block(scales={getattr(r, 'scale_dtype', None) or 'fp32'})", False, r.why)
    return Operand("fp8", False, r.why)


# ---------------------------------------------------------------------------------------------------------------
# operands -> policy text -> Plan
# ---------------------------------------------------------------------------------------------------------------
def _target(operands: dict[str, Operand]) -> str:
    specs = {o.spec for o in operands.values() if o.spec}
    if any(s.startswith(("nvfp4", "mxfp8")) for s in specs):
        return "blackwell"
    if any("scales=fp32" in s for s in specs):
        return "hopper"  # exact fp32 FP8-block scales are Hopper's (Blackwell TE requires pow2)
    return "blackwell"


def _layers(ls) -> str:
    return ", ".join(str(x) for x in sorted(ls))


def policy_text(name: str, operands: dict[str, Operand], arch, comment: str = "") -> str:
    """A policy whose plan on `arch` gives every linear tensor its operand: `default bf16`, one rule per (role,
    format) over the layers that run it, per-tensor name() rules where a role's tensors of one layer differ (and
    for MTP layers), one share_scale per fused family whose global scale the engine shares."""
    by_role_layer: dict[tuple, set] = defaultdict(set)
    tensors = [t for t in arch.tensors if t.hf_name in operands]
    for t in tensors:
        if t.layer is not None and t.mtp is None:
            by_role_layer[(t.role, t.layer)].add(operands[t.hf_name].spec)
    rules: "OrderedDict[tuple, set]" = OrderedDict()
    named: list[tuple[str, str]] = []
    shares: "OrderedDict[tuple, set]" = OrderedDict()
    for t in tensors:
        op = operands[t.hf_name]
        if op.spec is None:
            continue
        if t.layer is not None and t.mtp is None and len(by_role_layer[(t.role, t.layer)]) == 1:
            rules.setdefault((t.role, op.spec), set()).add(t.layer)
        else:
            named.append((t.hf_name, op.spec))
        if op.shared and "." in t.role and t.layer is not None and t.mtp is None:
            family, part = t.role.rsplit(".", 1)
            shares.setdefault((family,), set()).add((t.layer, part))
    lines = [f'policy "{name}" {{']
    lines += [f"    # {c}" for c in comment.splitlines() if c]
    lines += [f"    target {_target(operands)}", "    default bf16"]
    for (role, spec), ls in rules.items():
        lines.append(f"    layers[{_layers(ls)}].{role}: {spec}")
    for hf, spec in named:
        lines.append(f'    name("{hf}"): {spec}')
    for (family,), members in shares.items():
        parts = sorted({p for _, p in members})
        lines.append(f"    share_scale layers[{_layers({lay for lay, _ in members})}].{family}."
                     f"{{{', '.join(parts)}}}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def plan_of_policy(text: str, arch, filename: str, parallel=None):
    """Resolve generated policy text; a reading the plan IR cannot hold is an AuditError naming it."""
    from ..diagnostics import PolicyError
    from ..resolve import parse_policy, resolve

    try:
        return resolve(parse_policy(text, filename), arch, parallel)
    except PolicyError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AuditError(f"the {filename} reading cannot be written as a plan: {first}",
                         "the engine runs something the plan IR has no format for (e.g. a quantized NVFP4 "
                         "backward without NVTE_BACKWARD_OVERRIDE)") from None


# ---------------------------------------------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------------------------------------------
def trainer_operands(dep: Deployment, arch) -> dict[str, Operand]:
    import importlib.util

    from ..backends import megatron

    s = dep.trainer
    use_megatron = importlib.util.find_spec("megatron") is not None
    yamls = dict(s.yamls)
    name = megatron._flag(s.flags, "--te-precision-config-file") if hasattr(megatron, "_flag") else None
    if name is not None and megatron.TE_YAML not in yamls:
        doc = yamls.get(Path(name).name)
        if doc is not None:
            yamls = {megatron.TE_YAML: doc}
    import warnings

    try:
        with warnings.catch_warnings():  # megatron-core warns at import that TE / Apex are absent: not our news
            warnings.simplefilter("ignore")
            read = megatron.trainer_tensors(s.flags, yamls, s.env, arch, use_megatron=use_megatron,
                                            extra_hf=s.extra_hf, extra_megatron=s.extra_megatron)
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise AuditError(f"megatron-core cannot read the trainer's flags / TE YAML: {type(err).__name__}: {err}") \
            from None
    return {t.hf_name: trainer_operand(read[t.hf_name]) for t in arch.tensors if t.is_linear}


def rollout_operands(dep: Deployment, arch) -> dict[str, Operand]:
    s = dep.rollout
    if s.quant_config is not None and not isinstance(s.quant_config, dict):
        raise AuditError(f"the quantization config of {s.quant_from} is not an object")
    if s.engine == "vllm":
        from ..backends import vllm

        try:
            read = vllm.serve_tensors(s.quant_config, s.online, s.env, arch)
        except ValueError as err:
            raise AuditError(f"vLLM would refuse this configuration: {err}") from None
    else:
        from ..backends import sglang

        try:
            read = sglang.rollout_tensors(s.quant_config, s.env, s.flags, arch)
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            raise AuditError(f"SGLang cannot read the checkpoint's quantization config "
                             f"({s.quant_from}): {type(err).__name__}: {err}") from None
    return {t.hf_name: rollout_operand(read[t.hf_name]) for t in arch.tensors if t.is_linear and t.hf_name in read}


def _cell(t) -> str:
    w, a = t.weight.short(), t.activation.short()
    return w if w == a and not t.weight.is_quantized else f"W:{w} A:{a}"


def compare(trainer, rollout, t_ops: dict[str, Operand], r_ops: dict[str, Operand]) -> list[Disagreement]:
    """Per linear tensor both sides run: weight + activation formats; grouped by (both sides, cause)."""
    rmap = rollout.by_name()
    groups: "OrderedDict[tuple, list[str]]" = OrderedDict()
    for t in trainer.tensors:
        u = rmap.get(t.hf_name)
        if u is None or not t.is_linear or t.hf_name not in r_ops:
            continue
        if t.weight == u.weight and t.activation == u.activation:
            continue
        cause = "; ".join(("trainer: " + "; ".join(t_ops[t.hf_name].why),
                           "rollout: " + "; ".join(r_ops[t.hf_name].why)))
        groups.setdefault((_cell(t), _cell(u), cause), []).append(t.hf_name)
    return [Disagreement(names, a, b, c) for (a, b, c), names in groups.items()]


def audit(paths: list[Path], arch, parallel=None) -> AuditResult:
    dep = read_deployment([Path(p) for p in paths])
    t_ops = trainer_operands(dep, arch) if dep.trainer.present else None
    r_ops = rollout_operands(dep, arch) if dep.rollout.present else None
    tp = rp = trainer = rollout = None
    if t_ops is not None:
        tp = policy_text("audit-trainer", t_ops, arch, "what the trainer computes (policyc audit)")
        trainer = plan_of_policy(tp, arch, "audit-trainer", parallel)
    if r_ops is not None:
        rp = policy_text("audit-rollout", r_ops, arch, f"what the rollout ({dep.rollout.engine or 'sglang'}) "
                                                       "loads and computes (policyc audit)")
        rollout = plan_of_policy(rp, arch, "audit-rollout", parallel)
    res = AuditResult(dep.read_as, tp, rp, trainer, rollout)
    if trainer is not None and rollout is not None:
        res.disagreements = compare(trainer, rollout, t_ops, r_ops)
    return res


# ---------------------------------------------------------------------------------------------------------------
# display helpers (pure)
# ---------------------------------------------------------------------------------------------------------------
def to_json(res: AuditResult) -> dict:
    import json

    return {"agree": res.agree,
            "read_as": [{"path": p, "read_as": w} for p, w in res.read_as],
            "disagreements": [{"tensors": d.tensors, "count": len(d.tensors), "collapsed": [c for c, _ in
                                                                                           collapse_names(d.tensors, brace_single=False)],
                               "trainer": d.trainer, "rollout": d.rollout, "cause": d.cause}
                              for d in res.disagreements],
            "trainer": json.loads(res.trainer.to_json()) if res.trainer is not None else None,
            "rollout": json.loads(res.rollout.to_json()) if res.rollout is not None else None}
