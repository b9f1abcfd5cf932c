"""Locations of bundled data: grammar/, policies/ and models/.

In a source checkout (editable install) grammar/ and policies/ sit at the repository root; in a wheel they are
force-included under precision_dsl/_bundled/ (see pyproject.toml). Bundled models live in precision_dsl/models/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

_PKG = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    for cand in (_PKG / "_bundled" / name, _PKG.parent / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"bundled '{name}/' directory not found next to {_PKG}")


def grammar_path() -> Path:
    return _data_dir("grammar") / "policy.lark"


def policies_dir() -> Path:
    return _data_dir("policies")


def shipped_policies() -> list[str]:
    """Names (file stems) of the policies shipped with policyc."""
    return sorted(p.stem for p in policies_dir().glob("*.policy"))


def find_policy(ref: Union[str, Path]) -> Optional[Path]:
    """THE policy-file discovery rule, used by every command: an existing file path as given, else a shipped
    policy by name (`mxfp8-e2e` or `mxfp8-e2e.policy`). None when neither exists (see `policy_hint`)."""
    p = Path(ref)
    if p.is_file():
        return p
    shipped = policies_dir() / (p.name if p.suffix == ".policy" else p.name + ".policy")
    return shipped if p.parent == Path(".") and shipped.is_file() else None


def policy_hint() -> str:
    """What to tell a user whose policy was not found: the real location of the shipped policies (in an installed
    wheel that is inside site-packages, not a `policies/` folder of the current directory)."""
    return f"pass a .policy file or a shipped policy name: {', '.join(shipped_policies())} (in {policies_dir()})"


def models_dir() -> Path:
    return _PKG / "models"
