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
