"""The one backend interface and the registry of backends.

A backend turns a plan into the artifacts one engine reads (sqlglot dialect style: exactly, or a refusal naming the
tensor and the capability). Every backend is a registered `Backend` subclass with:

  * `name` (the `--backend` choice) and `description`;
  * `emit(plan, options, problems) -> [Artifact]`: records EVERY refusal in `problems` (common.Problems) instead of
    raising at the first; the artifacts are complete only when it recorded none. The default runs the backend's
    `artifacts(plan, options)`, a raising emitter that collects its own refusals into one BackendErrors;
  * `derive_formats(artifacts, arch) -> {hf_name: format}`: how the engine reads what was emitted (artifact
    relative path -> file bytes in; per HF tensor the `TensorFormat.short()` of the weight the engine will use
    out), independently of the plan: the fast self-check and what an audit of emitted files reads.

The gate and the CLI ask this module for the backends; they never name one. The backend modules are listed once,
below, and imported only when a backend is asked for (so `policyc plan` does not import them); each registers its
class with `@register_backend` when imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:  # pragma: no cover
    from precision_dsl.backends.common import Artifact, Problems

# The backend modules, in emit order (a backend's name is its module's last component).
_MODULES = {
    "megatron": "precision_dsl.backends.megatron",
    "sglang": "precision_dsl.backends.sglang",
    "vllm": "precision_dsl.backends.vllm",
    "converter": "precision_dsl.backends.converter",
    "weight_update": "precision_dsl.backends.weight_update.backend",
}


@dataclass(frozen=True)
class EmitOptions:
    """Engine versions and emitter options (every field has a default: `EmitOptions()` emits for the newest
    engines the backends know)."""

    te_version: Optional[str] = None  # installed TransformerEngine: refuse what it lacks (None: declare the minimum)
    vllm_version: Optional[str] = None  # vLLM to emit for (None: the backend's default)
    bucket_bytes: int = 512 << 20  # weight-update bucket size
    # The rollout engine the deployment serves with: the default backend set holds this one rollout backend (not
    # every registered one), and the backends that feed the rollout (checkpoint converter, weight update) write for it.
    rollout: str = "sglang"


class Backend:
    """Base class of every backend (see the module docstring). Subclasses set `name`, `role` and `description` and
    implement `derive_formats` and either `artifacts` (a raising emitter: the default `emit` records what it
    raises) or `emit` itself (a backend that collects its refusals as it goes)."""

    name: str = ""
    description: str = ""
    # "rollout" for a serving engine (one of them is chosen per deployment: EmitOptions.rollout); "trainer",
    # "checkpoint" and "update" backends are always part of the default set.
    role: str = ""

    def emit(self, plan, options: EmitOptions, problems: "Problems") -> list["Artifact"]:
        """`artifacts(plan, options)`, or [] with the refusals it raised (one UnsupportedByBackend, or BackendErrors
        naming several) recorded in `problems`."""
        return problems.run(self.artifacts, plan, options) or []

    def artifacts(self, plan, options: EmitOptions) -> list["Artifact"]:
        """The artifacts of `plan`; raises UnsupportedByBackend (BackendErrors for several) when it cannot."""
        raise NotImplementedError

    def derive_formats(self, artifacts: Mapping[str, bytes], arch) -> dict[str, str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


_REGISTERED: dict[str, Backend] = {}


def register_backend(cls: type) -> type:
    """Class decorator: register one instance of `cls` under `cls.name` (registering a name again replaces it)."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)) or not cls.name:
        raise TypeError(f"register_backend: {cls!r} is not a Backend subclass with a name")
    _REGISTERED[cls.name] = cls()
    return cls


def unregister_backend(name: str) -> None:
    """Remove a registered backend (tests that register their own)."""
    _REGISTERED.pop(name, None)


def backend_names() -> list[str]:
    """Every backend name, in emit order (the known modules first, then any registered from elsewhere), without
    importing the backend modules."""
    return list(_MODULES) + [n for n in _REGISTERED if n not in _MODULES]


def get_backend(name: str) -> Backend:
    """The registered backend `name` (its module imported on first use); KeyError if there is none."""
    if name not in _REGISTERED and name in _MODULES:
        importlib.import_module(_MODULES[name])
    try:
        return _REGISTERED[name]
    except KeyError:
        raise KeyError(f"no backend named {name!r} (backends: {', '.join(backend_names())})") from None


def rollout_names() -> list[str]:
    """The registered rollout engines (the `--rollout` choices), in emit order."""
    return [n for n in backend_names() if get_backend(n).role == "rollout"]


def default_names(options: Optional[EmitOptions] = None) -> list[str]:
    """The backends a deployment needs, in emit order: every non-rollout backend and the chosen rollout engine."""
    rollout = (options or EmitOptions()).rollout
    return [n for n in backend_names() if get_backend(n).role != "rollout" or n == rollout]


def backends(names: Optional[list[str]] = None, options: Optional[EmitOptions] = None) -> list[Backend]:
    """The backends `names` in the order given (default: `default_names(options)`)."""
    return [get_backend(n) for n in (default_names(options) if names is None else names)]
