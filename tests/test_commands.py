"""CLI: plan / explain / check / diff, through typer's runner, plus the pure rendering helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.cli import app
from precision_dsl.commands import diff_plans, plan_rows, role_summary, summarize
from precision_dsl.plan import Plan
from precision_dsl.resolve import resolve
from conftest import DENSE_RECIPES, StrictCliRunner

ROOT = Path(__file__).resolve().parent.parent
POL = ROOT / "policies"
NVFP4 = POL / "nvfp4-pertoken-dequant-backward.policy"
runner = StrictCliRunner()


@pytest.fixture(scope="module")
def dsv3_plan() -> Plan:
    return resolve(NVFP4, load_architecture("deepseek-v3"))


def test_deepseek_expert_share_is_656_5b_of_671b(dsv3_plan):
    roles, main, mtp = role_summary(dsv3_plan)
    experts = sum(n for g, n, _, _ in roles if g in ("routed_experts", "shared_experts"))
    assert experts == (61 - 3) * (256 + 1) * 3 * 7168 * 2048
    assert round(experts / 1e9, 1) == 656.5
    assert 670e9 < main < 672e9  # the model card's 671B: MTP module counted apart
    assert 13e9 < mtp < 15e9
    assert round(100 * experts / main, 1) == 97.8


def test_plan_cli_reports_expert_share(dsv3_plan):
    res = runner.invoke(app, ["plan", str(NVFP4), "--model", "deepseek-v3"])
    assert res.exit_code == 0, res.output
    assert "routed+shared experts: 656.5B of 671.0B parameters (97.8%)" in res.output
    assert "mlp.experts[0-255].{gate_proj,up_proj}" in res.output
    assert "plan hash: " + dsv3_plan.content_hash() in res.output
    assert "exact emulation" in res.output  # Blackwell-only formats are labelled as emulated here


def test_qwen3_last_15_percent_is_layers_40_to_47():
    plan = resolve(NVFP4, load_architecture("qwen3-30b-a3b"))
    expert_layers_nvfp4 = {t.layer for t in plan.tensors if t.role.startswith("routed_experts")
                           and t.weight.kind.value == "nvfp4"}
    assert expert_layers_nvfp4 == set(range(0, 40))
    rows = plan_rows(plan)
    labels = {r.layers for r in rows}
    assert "40-47" in labels and "0-39" in labels  # identical consecutive layers merged into those two runs
    res = runner.invoke(app, ["plan", str(NVFP4), "--model", "qwen3-30b-a3b"])
    assert res.exit_code == 0 and "40-47" in res.output


def test_plan_rows_expand_and_glob():
    plan = resolve(NVFP4, load_architecture("tiny-moe"))
    rows = plan_rows(plan, expand=True)
    assert {r.layers for r in rows} >= {"0", "1", "2", "3", "-"}
    only = plan_rows(plan, tensor_glob="model.layers.1.mlp.experts.*")
    assert only and all(r.layers == "1" for r in only)
    assert sum(r.count for r in only) == 8 * 3  # 8 experts x gate/up/down


def test_summary_adds_up():
    plan = resolve(NVFP4, load_architecture("tiny-moe"))
    rows = summarize(plan)
    assert sum(r[1] for r in rows) == sum(t.numel for t in plan.tensors)
    assert abs(sum(r[2] for r in rows) - 100.0) < 1e-6
    nv = [r for r in rows if r[0].startswith("nvfp4")]
    assert nv and all(r[4] < r[3] for r in nv)  # nvfp4 shrinks bytes


def test_plan_json_roundtrip_and_glob():
    res = runner.invoke(app, ["plan", str(NVFP4), "--model", "tiny-moe", "--json"])
    assert res.exit_code == 0
    plan = Plan.from_json(res.stdout)
    assert plan.policy_name == "nvfp4-pertoken-dequant-backward"
    res = runner.invoke(app, ["plan", str(NVFP4), "--model", "tiny-moe", "--json", "--tensor", "*.experts.0.*"])
    data = json.loads(res.stdout)
    assert {t["expert"] for t in data["tensors"]} == {0}


def test_explain_shows_chain_and_winner():
    res = runner.invoke(app, ["explain", str(NVFP4), "model.layers.45.mlp.experts.3.gate_proj.weight",
                              "--model", "qwen3-30b-a3b"])
    assert res.exit_code == 0, res.output
    assert res.output.count("✔ wins") == 1
    assert "overridden" in res.output
    assert "bf16" in res.output.split("✔ wins")[1].splitlines()[0]


def test_explain_unknown_tensor_is_a_clean_error():
    res = runner.invoke(app, ["explain", str(NVFP4), "model.layers.1.mlp.experts.3.gate_prj.weight"])
    assert res.exit_code == 2
    assert "did you mean" in res.output


def test_check_exit_codes(tmp_path):
    ok = runner.invoke(app, ["check", str(NVFP4), "--model", "qwen3-30b-a3b"])
    assert ok.exit_code == 0, ok.output
    # per-token activation scales with unequal expert-TP on trainer and rollout: refused
    bad = runner.invoke(app, ["check", str(NVFP4), "--model", "qwen3-30b-a3b",
                              "--parallel", "trainer:tp=2,etp=2,ep=4 rollout:tp=4,etp=1,ep=4"])
    assert bad.exit_code == 1, bad.output
    assert "etp" in bad.output.lower()
    assert "model.layers." in bad.output  # names a tensor


def test_check_hopper_refuses_nvfp4(tmp_path):
    p = tmp_path / "h.policy"
    p.write_text('policy "h" {\n  target hopper\n  default bf16\n  routed_experts: nvfp4\n}\n')
    res = runner.invoke(app, ["check", str(p), "--model", "tiny-moe"])
    assert res.exit_code in (1, 2)
    assert "hopper" in res.output.lower()


def test_bad_inputs_never_traceback(tmp_path):
    cases = [
        ["plan", str(tmp_path / "missing.policy")],
        ["plan", str(NVFP4), "--model", "no-such-model"],
        ["plan", str(NVFP4), "--parallel", "trainer:tq=2"],
        ["plan", str(NVFP4), "--tensor", "nothing.*"],
    ]
    bad = tmp_path / "bad.policy"
    bad.write_text('policy "x" {\n  routed_experts: nvfp5\n}\n')
    cases.append(["plan", str(bad)])
    for args in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert isinstance(res.exception, SystemExit)  # typer.Exit(2): a diagnostic, not a crash
        assert "error" in res.output.lower()
    res = runner.invoke(app, ["plan", str(bad)])
    assert "bad.policy:2:" in res.output and "^" in res.output


def test_diff_lists_changed_tensors():
    a, b = POL / "bf16.policy", NVFP4
    res = runner.invoke(app, ["diff", str(a), str(b), "--model", "tiny-moe"])
    assert res.exit_code == 0, res.output
    assert "mlp.experts" in res.output
    arch = load_architecture("tiny-moe")
    changes = diff_plans(resolve(a, arch), resolve(b, arch))
    # tiny-moe has 4 layers: the last (15% -> layer 3) stays bf16, so experts of layers 0-2 change
    changed = {n for n, _, _ in changes}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in changed
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" not in changed
    same = runner.invoke(app, ["diff", str(a), str(a), "--model", "tiny-moe"])
    assert "no tensor" in same.output


def test_arch_command_lists_names_with_megatron_parts():
    res = runner.invoke(app, ["arch", "tiny-moe", "--name", "model.layers.0.mlp.experts.0.*"])
    assert res.exit_code == 0, res.output
    assert "linear_fc1.weight0 [gate]" in res.output  # rich markup is escaped, not swallowed
    res = runner.invoke(app, ["arch", "tiny-moe", "--json", "--name", "lm_head*"])
    assert json.loads(res.stdout.splitlines()[0])["role"] == "lm_head"
    res = runner.invoke(app, ["arch", "no-such-model"])
    assert res.exit_code == 2 and res.output.count("hint:") == 1


def test_fast_plan_json_is_pydantics_bytes(dsv3_plan):
    """Plan.to_json builds the compact JSON from cached fragments; it must stay byte-identical to pydantic's own
    serializer (and round-trip), on the largest bundled plan (46k tensors, 12k share-scale groups)."""
    h = dsv3_plan.content_hash()
    fast = dsv3_plan.to_json()
    assert fast == '{"content_hash":' + json.dumps(h) + "," + dsv3_plan.model_dump_json()[1:]
    assert Plan.from_json(fast).content_hash() == h


def test_fast_plan_json_matches_pydantic_on_every_shipped_policy(tmp_path):
    """The per-group templates (plan._tensor_objects) on every shipped policy (rule texts with '%' and quotes) and on
    a policy whose rule text holds non-ASCII and JSON escapes, streamed in pieces as the CLI writes them."""
    arch = load_architecture("qwen3-30b-a3b")
    odd = tmp_path / "odd.policy"
    odd.write_text('policy "odd \u00e9" {\n    default bf16\n'
                   '    name("*.mlp.experts.1*"): mxfp8  # 50% "quoted" \\ é\n    layers[-10%:]: bf16\n}\n')
    for policy in [*sorted(p for p in POL.glob("*.policy") if p.stem not in DENSE_RECIPES), odd]:
        plan = resolve(policy, arch)
        want = '{"content_hash":' + json.dumps(plan.content_hash()) + "," + plan.model_dump_json()[1:]
        assert "".join(plan.json_pieces()) == plan.to_json() == want, policy.name


def test_plan_hints_that_check_refuses_a_quantized_lm_head(tmp_path):
    """`default mxfp8` on a dense model quantizes lm_head, which every trainer / rollout backend refuses: `plan`
    says so before `check` does, with the fix; the plan that follows the hint passes the gate."""
    from precision_dsl.engine.gate import run_gate

    pol = tmp_path / "d.policy"
    pol.write_text('policy "d" {\n  target blackwell\n  default mxfp8\n}\n')
    res = runner.invoke(app, ["plan", str(pol), "--model", "qwen3-8b"])
    assert res.exit_code == 0, res.output
    assert "hint: lm_head.weight is mxfp8" in res.output and "lm_head: bf16" in res.output
    assert "mxfp8-dense" in res.output
    assert runner.invoke(app, ["check", str(pol), "--model", "qwen3-8b"]).exit_code == 1
    pol.write_text('policy "d" {\n  target blackwell\n  default mxfp8\n  lm_head: bf16\n}\n')
    arch = load_architecture("qwen3-8b")
    assert run_gate(resolve(pol, arch), arch, ["megatron", "sglang"]).ok()
    assert "hint: lm_head" not in runner.invoke(app, ["plan", str(pol), "--model", "qwen3-8b"]).output
    assert "hint:" not in runner.invoke(app, ["plan", str(POL / "mxfp8-dense.policy"), "--model", "qwen3-8b"]).output


@pytest.mark.parametrize("model,fits,default", [
    ("qwen3-8b", "bf16, fp8-blockwise-hopper, mxfp8-dense, nvfp4-dense", "nvfp4-dense"),
    ("tiny-moe", "bf16, fp8-blockwise-hopper, language-tour, miles-nvfp4, mxfp8-dequant-backward, mxfp8-e2e, "
                 "mxfp8-hp-backward, nvfp4-pertoken-dequant-backward, nvfp4-pertoken-hp-backward, nvfp4-weight-only",
     "nvfp4-pertoken-dequant-backward")])
def test_arch_says_which_shipped_policies_fit(model, fits, default):
    res = runner.invoke(app, ["arch", model, "--name", "lm_head*"], terminal_width=400)
    assert res.exit_code == 0, res.output
    kind = "dense" if "dense" in default else "MoE"
    assert f"shipped policies that fit {model} ({kind}): {fits}; `policyc run` default: {default}" in \
        " ".join(res.output.split())


def test_explain_names_the_sglang_module_that_loads_a_fused_shared_expert(tmp_path):
    """DeepSeek-V3 BF16 on Hopper, rollout ep 1: SGLang fuses the shared expert into `mlp.experts`
    (tests/test_sglang_oracle.py proves it with SGLang's code); on Blackwell its MoE runner keeps it apart."""
    name = "model.layers.3.mlp.shared_experts.gate_proj.weight"
    hopper = tmp_path / "h.policy"
    hopper.write_text('policy "h" {\n  target hopper\n  default bf16\n}\n')
    res = runner.invoke(app, ["explain", str(hopper), name, "--model", "deepseek-v3"], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert "megatron: decoder.layers.3.mlp.shared_experts.linear_fc1.weight [gate]" in res.output
    assert "sglang:   model.layers.3.mlp.experts (SGLang 0.5.23 fuses the shared expert" in res.output
    res = runner.invoke(app, ["explain", str(POL / "bf16.policy"), name, "--model", "deepseek-v3"], terminal_width=400)
    assert res.exit_code == 0 and "sglang:   model.layers.3.mlp.shared_experts.gate_up_proj\n" in res.output
