"""`policyc check` and `policyc emit` are one gate (precision_dsl/engine/gate.py): what check accepts, emit emits; what an emitter
would refuse, check reports first; all problems are reported together. Over the shipped policies x models x layouts
of tests/matrix.py, plus the cases where the two once disagreed."""

from __future__ import annotations

import re

import pytest

from conftest import StrictCliRunner
from matrix import LAYOUTS, POLICIES, layout, policy_file
from precision_dsl.cli import app

runner = StrictCliRunner()


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_check_ok_iff_emit_ok_all_backends_tiny_moe(policy, lay, tmp_path):
    par = layout("tiny-moe", lay)
    extra = ["--parallel", par] if par else []
    chk = _cli("check", policy_file(policy), "--model", "tiny-moe", *extra)
    out = tmp_path / "out"
    emt = _cli("emit", policy_file(policy), "--model", "tiny-moe", "--out", out, *extra)
    assert chk.exit_code in (0, 1) and emt.exit_code in (0, 1), chk.output + emt.output
    assert (chk.exit_code == 0) == (emt.exit_code == 0), f"check:\n{chk.output}\nemit:\n{emt.output}"
    assert out.is_dir() == (emt.exit_code == 0)  # a refused emit writes nothing
    if chk.exit_code:
        # the same errors, reported by both
        errs = sorted(set(re.findall(r"error \[([a-z0-9-]+)\]", chk.output)))
        assert errs and errs == sorted(set(re.findall(r"error \[([a-z0-9-]+)\]", emt.output))), (chk.output,
                                                                                                 emt.output)
        assert "Traceback" not in chk.output + emt.output


def test_emit_refuses_a_layout_check_refuses(tmp_path):
    pol = policy_file("nvfp4-pertoken-hp-backward")
    par = "trainer:tp=2,etp=2,ep=4 rollout:tp=4,etp=1,ep=4"
    chk = _cli("check", pol, "--model", "qwen3-30b-a3b", "--parallel", par, "-b", "megatron")
    emt = _cli("emit", pol, "--model", "qwen3-30b-a3b", "--parallel", par, "-b", "megatron", "--out", tmp_path / "o")
    assert chk.exit_code == emt.exit_code == 1
    assert not (tmp_path / "o").exists()
    # both problems at once: unequal expert-TP of per-token scales (static) and NVFP4 amax per expert-TP shard
    for res in (chk, emt):
        assert "etp-mismatch" in res.output and "unsupported-by-megatron" in res.output, res.output


def test_check_reports_what_emit_would_refuse():
    # a refusal only emit used to find (NVFP4 per-tensor weight scale under expert-TP 2) is check's too
    res = _cli("check", policy_file("nvfp4-pertoken-hp-backward"), "--model", "tiny-moe",
               "--parallel", "trainer:etp=2,ep=2 rollout:etp=2,ep=2", "-b", "megatron")
    assert res.exit_code == 1 and "unsupported-by-megatron" in res.output and "TP=2" in res.output


def test_deepseek_uneven_pipelines_agree(tmp_path):
    # DeepSeek-V3 (61 layers) under pipeline parallelism: check and emit give one verdict. pp=4 is
    # laid out unevenly (16/15/15/15); pp=16 is refused by both, by name - its 10 BF16 tail layers exceed
    # --num-layers-at-end-in-bf16's cap (61 // 16 = 3) and one TE file cannot single them out on every stage
    pol = policy_file("mxfp8-e2e")
    for pp, code in (("4", 0), ("16", 1)):
        par = f"trainer:pp={pp}"
        out = tmp_path / f"o{pp}"
        chk = _cli("check", pol, "--model", "deepseek-v3", "--parallel", par, "-b", "megatron")
        emt = _cli("emit", pol, "--model", "deepseek-v3", "--parallel", par, "-b", "megatron", "--out", out)
        assert chk.exit_code == emt.exit_code == code, chk.output + emt.output
        if code:
            assert "stage-local" in chk.output and "stage-local" in emt.output and not out.exists()
        else:
            args = (out / "megatron" / "args.txt").read_text()
            assert "--decoder-first-pipeline-num-layers 16 --decoder-last-pipeline-num-layers 15" in args


def test_te_version_refusal_names_the_capability(tmp_path):
    pol = policy_file("mxfp8-dequant-backward")
    for cmd in (["check"], ["emit", "--out", tmp_path / "o"]):
        res = _cli(*cmd, pol, "--model", "tiny-moe", "--te-version", "2.14.0")
        assert res.exit_code == 1 and "NVTE_BACKWARD_OVERRIDE" in res.output and "2.14.0" in res.output
    assert _cli("check", pol, "--model", "tiny-moe", "--te-version", "2.18.0").exit_code == 0
    bad = _cli("check", pol, "--model", "tiny-moe", "--te-version", "latest")
    assert bad.exit_code == 2 and "--te-version" in bad.output
