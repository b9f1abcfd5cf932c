"""Every shipped policy either emits all four backends' artifacts, or is refused with a named tensor and capability
(never a traceback, never a silent approximation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_dsl.cli import app

from conftest import EMITTING_POLICIES, StrictCliRunner

ROOT = Path(__file__).resolve().parent.parent
runner = StrictCliRunner()
EMITS = EMITTING_POLICIES


@pytest.mark.parametrize("policy", EMITS)
@pytest.mark.parametrize("model", ["tiny-moe", "qwen3-30b-a3b"])
def test_shipped_policy_emits(policy, model, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["emit", str(ROOT / "policies" / f"{policy}.policy"), "--model", model, "--out", str(out)])
    assert res.exit_code == 0, res.output
    for part in ("policyc_plan.json", "megatron/args.txt", "sglang/server_args.json", "converter/manifest.json",
                 "weight_update/manifest.json"):
        assert (out / part).is_file(), part


def test_weight_only_nvfp4_is_refused_by_name(tmp_path):
    res = runner.invoke(app, ["emit", str(ROOT / "policies" / "nvfp4-weight-only.policy"), "--model", "tiny-moe",
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 1, res.output
    assert "model.layers." in res.output
    assert not (tmp_path / "o").exists()  # nothing half-written


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-0.6b", "llama-3.2-1b"])
def test_dense_policies_emit_or_are_refused_by_name(model, tmp_path):
    """Dense models: mxfp8-dense (and bf16, fp8-blockwise-hopper) emit every default backend; nvfp4-dense is a
    trainer recipe: Megatron/TE and the weight update emit it, the SGLang rollout refuses per-token NVFP4 on dense
    linears by name (its dense ModelOpt FP4 linear uses a static input_scale)."""
    for policy in ("mxfp8-dense", "bf16", "fp8-blockwise-hopper"):
        out = tmp_path / policy
        res = runner.invoke(app, ["emit", str(ROOT / "policies" / f"{policy}.policy"), "--model", model,
                                  "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert (out / "sglang/launch_args.txt").is_file() and (out / "megatron/args.txt").is_file()
    nv = str(ROOT / "policies" / "nvfp4-dense.policy")
    res = runner.invoke(app, ["emit", nv, "--model", model, "--out", str(tmp_path / "nv")])
    assert res.exit_code == 1 and "unsupported-by-sglang" in res.output and "mlp.gate_proj" in res.output, res.output
    assert not (tmp_path / "nv").exists()
    res = runner.invoke(app, ["emit", nv, "--model", model, "-b", "megatron", "-b", "weight_update",
                              "--out", str(tmp_path / "nv-trainer")])
    assert res.exit_code == 0, res.output
    assert "nvfp4" in (tmp_path / "nv-trainer/megatron/args.txt").read_text()
