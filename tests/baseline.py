"""Behaviour fingerprint of policyc: the proof that a refactor changed nothing a user can observe.

    python tests/baseline.py            # (re)write tests/data/baseline_hashes.json -- only when behaviour is MEANT
                                        # to change, and say why in the commit message

Figures: the content hash of every shipped policy x bundled model plan (or the exact refusal), its byte accounting
(bytes before/after of every tensor, as one sha256), the sha256 of every
artifact `policyc emit` writes for tiny-moe, and the sha256 of every file the checkpoint converter writes for the
bundled tiny-moe checkpoint under each shipped policy (or the exact refusal). tests/test_baseline.py recomputes
them and compares. Recorded before everything moved under the one import name `precision_dsl`, so the figures are
the behaviour that move (and every refactor since) had to keep.
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
# The bundled models when the figures were first recorded. Models bundled later (kimi-k2, glm-4.5-air,
# qwen3-235b-a22b, qwen3-8b) are covered by tests/test_public_models.py instead: 11 policies x Kimi-K2's
# 70k tensors alone would add minutes to every run of this suite.
MODELS = ("deepseek-v3", "llama-3.2-1b", "qwen3-0.6b", "qwen3-30b-a3b", "tiny-moe")


def policies() -> list[Path]:
    return sorted((ROOT / "policies").glob("*.policy"))


# TensorPlan fields added after the recording (the IR carries fused groups and the source dtype / format). They
# are left out of content_hash; a plan JSON file is compared with them removed, everything else byte for byte.
NEW_IR_FIELDS = {"fused_group", "source_dtype", "source_format"}  # source_format: FP8-block sources
PLAN_FILE = "policyc_plan.json"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(name: str, data: bytes) -> str:
    # artifacts name the policy file by absolute path: hash them relative to the checkout, so that the figures hold
    # in any worktree or clone (CI runs from a fresh clone elsewhere)
    data = data.replace(str(ROOT).encode() + b"/", b"")
    if not name.endswith(PLAN_FILE):
        return _sha(data)
    from precision_dsl.plan import Plan

    plan = Plan.from_json(data.decode())
    fields = set(Plan.model_fields["tensors"].annotation.__args__[0].model_fields) & NEW_IR_FIELDS
    assert all(f'"{f}":' in data.decode() for f in fields), "plan JSON lacks the IR's new fields"
    body = plan.model_dump_json(exclude={"tensors": {"__all__": fields}} if fields else None)
    return _sha(('{"content_hash":' + json.dumps(plan.content_hash()) + "," + body[1:] + "\n").encode())


def _refusal(err: Exception) -> str:
    # paths relative to the checkout, so that the figures hold in any worktree or clone
    return f"refused: {type(err).__name__}: {err}".replace(str(ROOT) + "/", "")


def _plans():
    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    for model in MODELS:
        arch = load_architecture(model)
        for pol in policies():
            try:
                yield f"{pol.stem}@{model}", resolve(pol, arch, None)
            except Exception as err:  # a refusal is behaviour too: record it exactly
                yield f"{pol.stem}@{model}", _refusal(err)


def plan_figures() -> tuple[dict, dict]:
    """(content hash, sha256 of every tensor's `name|bytes_before|bytes_after`) of every policy x model plan."""
    hashes, sizes = {}, {}
    for key, plan in _plans():
        if isinstance(plan, str):
            hashes[key] = sizes[key] = plan
            continue
        hashes[key] = plan.content_hash()
        sizes[key] = _sha("\n".join(f"{t.hf_name}|{t.bytes_before}|{t.bytes_after}" for t in plan.tensors).encode())
    return hashes, sizes


def emitted(model: str = CONVERT_MODEL) -> dict:
    from precision_dsl.arch import load_architecture
    from precision_dsl.backends import cli as backend_cli
    from precision_dsl.backends.registry import backend_names
    from precision_dsl.resolve import resolve

    arch = load_architecture(model)
    out = {}
    for pol in policies():
        try:
            plan = resolve(pol, arch, None)
        except Exception as err:  # a recipe for other models (the dense ones on tiny-moe): its refusal is recorded
            out[pol.stem] = _refusal(err)
            continue
        for backend in backend_names():
            try:
                arts = backend_cli.emit_artifacts(plan, [backend])
            except Exception as err:
                out[f"{pol.stem}/{backend}"] = _refusal(err)
                continue
            out[f"{pol.stem}/{backend}"] = {a.path: _file_sha(a.path, a.data()) for a in arts}
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
            try:
                plan = resolve(pol, arch, None)
            except Exception as err:
                out[pol.stem] = _refusal(err)
                continue
            dst = Path(tmp) / pol.stem
            try:
                converter.convert(src, plan, dst)
            except Exception as err:
                out[pol.stem] = _refusal(err)
                continue
            out[pol.stem] = {str(p.relative_to(dst)): _file_sha(p.name, p.read_bytes())
                             for p in sorted(dst.rglob("*")) if p.is_file()}
    return out


def compute() -> dict:
    hashes, sizes = plan_figures()
    return {"plan_hashes": hashes, "plan_bytes": sizes, "emitted": emitted(), "converted": converted()}


if __name__ == "__main__":
    figures = compute()
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}: {len(figures['plan_hashes'])} plans, {len(figures['emitted'])} emits, "
          f"{len(figures['converted'])} conversions", file=sys.stderr)
