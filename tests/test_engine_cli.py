"""engine/cli.py + miles.py: `policyc run` end to end (tiny), error paths without tracebacks, the Miles dry run."""

from __future__ import annotations

import json

import pytest

from precision_dsl.cli import app
from conftest import StrictCliRunner

runner = StrictCliRunner()


def test_run_writes_metrics_summary_and_plot(tmp_path):
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", "mxfp8-dequant-backward", "--steps", "2", "--prompts", "4", "--samples", "4",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["step"] == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "mxfp8-dequant-backward" and s["quantized_weights_identical_every_step"] is True
    assert (out / "run.png").stat().st_size > 10_000
    assert "emulated" in r.output
    # a second run into the same non-empty directory is refused (never overwrite results silently)
    r2 = runner.invoke(app, ["run", "bf16", "--steps", "1", "--out", str(out)])
    assert r2.exit_code == 2 and "not empty" in r2.output


@pytest.mark.parametrize("args,needle", [
    (["run", "no-such-policy"], "no such file and not a shipped policy"),
    (["run", "--task", "nope"], "unknown task"),
    (["run", "mxfp8-e2e", "--broken-contract", "per_tensor", "--steps", "1"], "no per-token NVFP4"),
    (["run", "--model", "/nonexistent/dir"], "neither a directory nor a bundled model"),
    (["run", "--micro-batch", "0"], "--micro-batch"),
])
def test_errors_are_messages_not_tracebacks(tmp_path, args, needle):
    r = runner.invoke(app, args + ["--out", str(tmp_path / "o")])
    assert r.exit_code != 0
    assert needle in r.output, r.output


def test_miles_dry_run_emits_complete_launch(tmp_path):
    out = tmp_path / "miles"
    r = runner.invoke(app, ["run", "--engine", "miles", "nvfp4-pertoken-dequant-backward", "--model", "qwen3-30b-a3b",
                            "--parallel", "trainer:tp=4,ep=8 rollout:tp=8,ep=8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    script = (out / "launch_miles.sh").read_text()
    plan = json.loads((out / "policyc_plan.json").read_text())
    assert plan["content_hash"] in script
    for needle in ["--fp4-recipe nvfp4", "--te-precision-config-file \"$HERE\"/megatron/te_precision.yaml",
                   "export NVTE_NVFP4_ROW_SCALED_ACTIVATION=1", "export NVTE_BACKWARD_OVERRIDE=dequantized",
                   "export SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1", "--sglang-quantization modelopt_fp4",
                   "--sglang-tp-size 8", "--expert-model-parallel-size 8", "policyc convert",
                   "--update-weight-transfer-mode broadcast", "--check-weight-update-equal",
                   "--n-samples-per-prompt 8", "--kl-loss-coef 0.0"]:
        assert needle in script, needle
    assert (out / "megatron" / "te_precision.yaml").exists() and (out / "sglang" / "server_args.json").exists()
    import subprocess

    assert subprocess.run(["bash", "-n", str(out / "launch_miles.sh")]).returncode == 0


def test_miles_launch_without_miles_is_a_clear_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("miles") is not None:
        pytest.skip("Miles is installed here")
    r = runner.invoke(app, ["run", "--engine", "miles", "mxfp8-e2e", "--model", "tiny-moe", "--launch",
                            "--out", str(tmp_path / "m")])
    assert r.exit_code == 2 and "Miles is not installed" in r.output
    assert (tmp_path / "m" / "launch_miles.sh").exists()


def test_a_plan_the_gate_refuses_exits_1_from_every_command(tmp_path):
    """One exit-code contract: 1 = valid input that the gate refuses (check, emit and run --engine miles alike),
    2 = bad usage."""
    bad = ["nvfp4-pertoken-dequant-backward", "--model", "qwen3-30b-a3b",
           "--parallel", "trainer:tp=2,etp=2,ep=4 rollout:tp=4,etp=1,ep=4"]
    check = runner.invoke(app, ["check", "policies/nvfp4-pertoken-dequant-backward.policy", *bad[1:]])
    assert check.exit_code == 1, check.output
    r = runner.invoke(app, ["run", "--engine", "miles", *bad, "--out", str(tmp_path / "m")])
    assert r.exit_code == 1 and "does not pass `policyc check`" in r.output, r.output
