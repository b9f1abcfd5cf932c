"""The user's first question, "does it take my model?": the public config.json of each model RL teams train, used as
a user would (a file in a download directory, not a bundled name), through `policyc plan`, `check` and `emit` with a
shipped policy. Exit code 0, no traceback (CliRunner(catch_exceptions=False)), every artifact stamped with the plan
hash, and the family / source precision the plan reports is the right one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import StrictCliRunner

from precision_dsl.cli import app

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "precision_dsl" / "models"

# (bundled public config, shipped policy, family it must dispatch to, FP8-block source release?)
CASES = [
    ("kimi-k2", "fp8-blockwise-hopper", "deepseek_v3", True),
    ("deepseek-v3", "nvfp4-pertoken-hp-backward", "deepseek_v3", True),
    ("glm-4.5-air", "mxfp8-e2e", "glm4_moe", False),
    ("qwen3-235b-a22b", "nvfp4-pertoken-hp-backward", "qwen3_moe", False),
    ("qwen3-30b-a3b", "miles-nvfp4", "qwen3_moe", False),
    ("qwen3-8b", "fp8-blockwise-hopper", "qwen3", False),
]


@pytest.mark.parametrize("model,policy,family,fp8_source", CASES, ids=[c[0] for c in CASES])
def test_public_config_plans_checks_and_emits(tmp_path, model, policy, family, fp8_source):
    user_dir = tmp_path / "downloads" / model
    user_dir.mkdir(parents=True)
    shutil.copyfile(MODELS / model / "config.json", user_dir / "config.json")
    pol = str(REPO / "policies" / f"{policy}.policy")
    runner = StrictCliRunner()

    res = runner.invoke(app, ["plan", pol, "--model", str(user_dir)])
    assert res.exit_code == 0, res.output
    assert f"({family}," in res.output
    plan_hash = re.search(r"plan hash: (sha256:[0-9a-f]{64})", res.output).group(1)

    res = runner.invoke(app, ["check", pol, "--model", str(user_dir)])
    assert res.exit_code == 0, res.output

    out = tmp_path / "emitted"
    # The trainer and rollout configs for every model; the per-tensor converter / weight-update manifests (tens of MB
    # for the 46k-70k tensors of the DeepSeek-V3 family) for the others, to keep the suite's time in budget.
    backends = ["megatron", "sglang"] + ([] if family == "deepseek_v3" else ["converter", "weight_update"])
    res = runner.invoke(app, ["emit", pol, "--model", str(user_dir), "--out", str(out)]
                        + [x for b in backends for x in ("--backend", b)])
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "policyc_plan.json").read_text())
    assert plan["content_hash"] == plan_hash and plan["model_type"] == family
    manifests = {"megatron": "megatron/flags.json", "sglang": "sglang/server_args.json",
                 "converter": "converter/manifest.json", "weight_update": "weight_update/manifest.json"}
    for b in backends:
        assert json.loads((out / manifests[b]).read_text())["policyc"]["content_hash"] == plan_hash, b
    sources = {(t["source_dtype"], (t["source_format"] or {}).get("kind")) for t in plan["tensors"] if t["is_linear"]}
    assert (("float8_e4m3fn", "fp8_block") in sources) == fp8_source


def test_glm_air_fp8_block_is_refused_by_name(tmp_path):
    """GLM-4.5-Air's dense layer has intermediate_size 10944 = 85.5 x 128: SGLang's FP8-block linears need K % 128,
    so emitting the Hopper FP8-block policy names the tensor instead of writing a config the server rejects."""
    res = StrictCliRunner().invoke(app, ["emit", str(REPO / "policies" / "fp8-blockwise-hopper.policy"), "--model",
                                   "glm-4.5-air", "--out", str(tmp_path / "o")])
    assert res.exit_code != 0
    assert "model.layers.0.mlp.down_proj.weight" in res.output and "128" in res.output
    assert not (tmp_path / "o").exists()


def test_arch_lists_every_family_with_an_example():
    from precision_dsl.arch import list_bundled, load_architecture
    from precision_dsl.arch.families import FAMILIES

    res = StrictCliRunner().invoke(app, ["arch"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    for f in FAMILIES:
        assert f.model_type in res.output and all(a in res.output for a in f.architectures)
        if f.example:  # the example is bundled and really is that family
            assert f.example in res.output and f.example in list_bundled()
            assert load_architecture(f.example).model_type == f.model_type
    assert "kimi_k2" in res.output
