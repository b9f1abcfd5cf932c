"""Behaviour fingerprint of policyc: the proof that a refactor changed nothing a user can observe.

    python tests/baseline.py            # (re)write tests/data/baseline_hashes.json -- only when behaviour is MEANT
                                        # to change, and say why in the commit message

Figures: the content hash of every shipped policy x bundled model plan (or the exact refusal), the sha256 of every
artifact `policyc emit` writes for tiny-moe, and the sha256 of every file the checkpoint converter writes for the
bundled tiny-moe checkpoint under each shipped policy (or the exact refusal). tests/test_baseline.py recomputes
them and compares. Recorded on the commit before issue 14's restructure ("one house").
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "baseline_hashes.json"
CONVERT_MODEL = "tiny-moe"


def policies() -> list[Path]:
    return sorted((ROOT / "policies").glob("*.policy"))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _refusal(err: Exception) -> str:
    # paths relative to the checkout, so that the figures hold in any worktree or clone
    return f"refused: {type(err).__name__}: {err}".replace(str(ROOT) + "/", "")


def plan_hashes(models=None) -> dict:
    from precision_dsl.arch import list_bundled, load_architecture
    from precision_dsl.resolve import resolve

    out = {}
    for model in models or list_bundled():
        arch = load_architecture(model)
        for pol in policies():
            try:
                out[f"{pol.stem}@{model}"] = resolve(pol, arch, None).content_hash()
            except Exception as err:  # a refusal is behaviour too: record it exactly
                out[f"{pol.stem}@{model}"] = _refusal(err)
    return out


def emitted(model: str = CONVERT_MODEL) -> dict:
    from precision_dsl.arch import load_architecture
    from precision_dsl.backends import cli as backend_cli
    from precision_dsl.resolve import resolve

    arch = load_architecture(model)
    out = {}
    for pol in policies():
        plan = resolve(pol, arch, None)
        for backend in backend_cli.BACKEND_CHOICES:
            try:
                arts = backend_cli.emit_artifacts(plan, [backend])
            except Exception as err:
                out[f"{pol.stem}/{backend}"] = _refusal(err)
                continue
            out[f"{pol.stem}/{backend}"] = {a.path: _sha(a.data()) for a in arts}
    return out


def converted(model: str = CONVERT_MODEL) -> dict:
    from precision_dsl.arch import load_architecture
    from precision_dsl.backends import converter
    from precision_dsl.resolve import resolve
    from precision_dsl.resources import models_dir

    arch = load_architecture(model)
    src = models_dir() / model
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pol in policies():
            plan = resolve(pol, arch, None)
            dst = Path(tmp) / pol.stem
            try:
                converter.convert(src, plan, dst)
            except Exception as err:
                out[pol.stem] = _refusal(err)
                continue
            out[pol.stem] = {str(p.relative_to(dst)): _sha(p.read_bytes())
                             for p in sorted(dst.rglob("*")) if p.is_file()}
    return out


def compute() -> dict:
    return {"plan_hashes": plan_hashes(), "emitted": emitted(), "converted": converted()}


if __name__ == "__main__":
    figures = compute()
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}: {len(figures['plan_hashes'])} plans, {len(figures['emitted'])} emits, "
          f"{len(figures['converted'])} conversions", file=sys.stderr)
