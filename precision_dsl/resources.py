"""Locations of bundled data: grammar/, policies/ and models/.

In a source checkout (editable install) grammar/ and policies/ sit at the repository root; in a wheel they are
force-included under precision_dsl/_bundled/ (see pyproject.toml). Bundled models live in precision_dsl/models/.
"""

from __future__ import annotations

from pathlib import Path

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


def models_dir() -> Path:
    return _PKG / "models"
