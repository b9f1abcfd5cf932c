"""One gate for `policyc check`, `policyc emit` and `policyc run --engine miles`.

It lives in the engine layer because it joins the static checks (resolve layer) and the backends, which must not
import each other (docs/ARCHITECTURE.md); the cli commands and the Miles launch call it.

Both commands call `run_gate`: it runs every static check of precision_dsl.checks AND every chosen backend
emitter, and collects all findings (sqlglot's ErrorLevel idea: report everything, not the first). So

  * what `check` accepts, `emit` emits (the emitters already ran inside check and produced the artifacts);
  * what an emitter would refuse (UnsupportedByBackend), `check` reports as an error `unsupported-by-<backend>`,
    naming the tensor and the capability;
  * `emit` writes nothing unless the gate passes (errors; warnings too with --strict).

The backends come from the registry (backends/registry.py): the gate names none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..backends.common import Artifact, Problems, UnsupportedByBackend, plan_artifact
from ..backends.registry import EmitOptions, backends as registered_backends
from ..diagnostics import Diagnostic


@dataclass
class GateResult:
    diagnostics: list[Diagnostic] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)  # complete only when ok

    def errors(self, strict: bool = False) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error" or strict]

    def ok(self, strict: bool = False) -> bool:
        return not self.errors(strict)


def refusal_diagnostics(err: UnsupportedByBackend) -> list[Diagnostic]:
    return [Diagnostic(severity="error", code=f"unsupported-by-{e.backend}", tensor=e.tensor,
                       message=f"{e.tensor}: {e.capability}",
                       hint=e.hint or "change the policy for this tensor, or emit only the other backends with "
                                      "--backend")
            for e in (getattr(err, "errors", None) or [err])]


def run_gate(plan, arch, backends: Optional[list[str]] = None, options: Optional[EmitOptions] = None) -> GateResult:
    """Static checks + every chosen backend (default: the deployment's backends for `options.rollout`, in emit
    order) under `options`."""
    from ..checks import check

    options = options or EmitOptions()
    res = GateResult(diagnostics=list(check(plan, arch, plan.parallel)))
    res.artifacts.append(plan_artifact(plan, "the plan (IR) with its content_hash"))
    for backend in registered_backends(backends or None, options):
        problems = Problems()
        arts = backend.emit(plan, options, problems)
        if problems.items:
            for err in problems.folded():
                res.diagnostics += refusal_diagnostics(err)
            continue
        res.artifacts.extend(arts)
    return res
