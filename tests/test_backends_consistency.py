"""The four consumers agree: for every shipped seed policy and bundled architecture, `policyc emit` writes artifacts
from which the weight format of every tensor is derived back INDEPENDENTLY per backend, each through its registered
`Backend.derive_formats(artifacts, arch)` (backends/registry.py) -

  megatron       flags + TE precision YAML(s), resolved through megatron-core's own loader/matcher
  sglang         the checkpoint quantization_config, matched with SGLang's exemption rules
  converter      the announced output tensors (X.weight_scale_inv U8 -> mxfp8, X.weight_scale_2 -> nvfp4, ...)
  weight_update  the per-Megatron-parameter rollout tensors of the update manifest

- and all four are equal to each other and to the plan. Every artifact carries the plan's content hash."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import megatron.core.quantization.quant_config  # noqa: F401  the megatron reading below must use megatron-core
import pytest

from precision_dsl.backends.cli import emit_artifacts
from precision_dsl.backends.common import PLAN_FILE, write_tree_atomic
from precision_dsl.backends.registry import default_names, get_backend
from precision_dsl.arch import load_architecture
from precision_dsl.resolve import resolve

from conftest import SEED_POLICIES, StrictCliRunner

REPO = Path(__file__).resolve().parents[1]
SEEDS = SEED_POLICIES
MODELS = ["tiny-moe", "qwen3-30b-a3b", pytest.param("deepseek-v3", marks=pytest.mark.slow)]


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


def quantized(formats: dict[str, str]) -> dict[str, str]:
    return {n: f for n, f in formats.items() if f not in ("bf16", "fp16", "fp32")}


def read_tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def derive_all(out: Path, arch) -> dict[str, dict[str, str]]:
    files = read_tree(out)
    # the deployment's backends, what `policyc emit` writes by default (one rollout engine: sglang)
    return {name: get_backend(name).derive_formats(files, arch) for name in default_names()}


def hashes_in(out: Path) -> set[str]:
    """Every plan hash mentioned by any artifact; each artifact file must mention at least one."""
    found = set()
    for p in out.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".yaml", ".sh", ".txt"):
            hs = set(re.findall(r"sha256:[0-9a-f]{64}", p.read_text()))
            if p.suffix != ".txt" and p.name != "hf_quant_config.json":
                assert hs, f"{p} carries no plan hash"
            found |= hs
    return found


@pytest.mark.parametrize("model", MODELS)
def test_all_backends_agree_on_every_seed_policy(model, tmp_path):
    arch = arch_of(model)
    for seed in SEEDS:
        plan = resolve(REPO / "policies" / f"{seed}.policy", arch, None)
        out = tmp_path / seed
        write_tree_atomic(out, emit_artifacts(plan))
        want = quantized({t.hf_name: t.weight.short() for t in plan.tensors if t.is_linear})
        derived = {b: quantized(k) for b, k in derive_all(out, arch).items()}
        for backend, got in derived.items():
            assert got == want, (f"{seed} on {model}: {backend} disagrees with the plan on "
                                 f"{sorted(set(got.items()) ^ set(want.items()))[:4]}")
        assert (seed == "bf16") == (not want)
        assert hashes_in(out) == {plan.content_hash()}, f"{seed}: an artifact lacks or has another plan hash"
        assert json.loads((out / PLAN_FILE).read_text())["content_hash"] == plan.content_hash()


def test_emit_cli_writes_all_backends_with_parallel_layout(tmp_path):
    from precision_dsl.cli import app

    out = tmp_path / "emit"
    pol = str(REPO / "policies" / "nvfp4-pertoken-hp-backward.policy")
    r = StrictCliRunner().invoke(app, ["emit", pol, "--model", "tiny-moe", "--parallel",
                                 "trainer:tp=2,etp=1,ep=2,pp=2 rollout:tp=2,ep=2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    derived = {b: quantized(k) for b, k in derive_all(out, arch_of("tiny-moe")).items()}
    assert len({tuple(sorted(d.items())) for d in derived.values()}) == 1
    args = (out / "megatron/args.txt").read_text().split()
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "2"
    sg = json.loads((out / "sglang/server_args.json").read_text())["server_args"]
    assert sg[sg.index("--ep-size") + 1] == "2"
    # existing output is refused without --force; one backend only with --backend
    r = StrictCliRunner().invoke(app, ["emit", pol, "--model", "tiny-moe", "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.output
    r = StrictCliRunner().invoke(app, ["emit", pol, "--model", "tiny-moe", "--out", str(out), "--force", "-b", "sglang"])
    assert r.exit_code == 0 and not (out / "megatron").exists() and (out / "sglang").is_dir()


def test_emit_cli_unsupported_is_exit_1_without_traceback(tmp_path):
    from precision_dsl.cli import app

    pol = str(REPO / "policies" / "nvfp4-pertoken-hp-backward.policy")
    r = StrictCliRunner().invoke(app, ["emit", pol, "--model", "tiny-moe", "--parallel", "trainer:etp=2,ep=2",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "unsupported-by-megatron" in r.output and "nothing written" in r.output
    assert not (tmp_path / "o").exists()  # nothing half-written
    r = StrictCliRunner().invoke(app, ["emit", pol, "--model", "tiny-moe", "--out", str(tmp_path / "o"), "-b", "nope"])
    assert r.exit_code == 2 and "unknown backend" in r.output


def test_consumers_refuse_artifacts_of_another_plan(tmp_path):
    from precision_dsl.backends.common import PlanMismatch, check_artifacts

    arch = arch_of("tiny-moe")
    a = resolve(REPO / "policies" / "mxfp8-e2e.policy", arch, None)
    b = resolve(REPO / "policies" / "mxfp8-hp-backward.policy", arch, None)
    write_tree_atomic(tmp_path / "a", emit_artifacts(a))
    checked = check_artifacts(tmp_path / "a", a)
    assert {"megatron/flags.json", "megatron/env.sh", "sglang/server_args.json", "converter/manifest.json",
            "weight_update/manifest.json", PLAN_FILE} <= set(checked)
    with pytest.raises(PlanMismatch):
        check_artifacts(tmp_path / "a", b)
