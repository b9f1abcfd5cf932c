"""SGLang 0.5.23's own code judges what policyc emits for it (tests/oracles/sglang_oracle.py).

For every shipped policy x {tiny-moe, qwen3-30b-a3b, deepseek-v3} x rollout layouts (none; TP 8 + EP 8; TP 4 + EP 2
+ PP 2, i.e. moe-TP 2), policyc either refuses by name (UnsupportedByBackend naming tensor + capability), or SGLang - given
exactly the checkpoint config.json / hf_quant_config.json `policyc convert` writes and the emitted launch args + env -
parses and resolves the args (its real ServerArgs pipeline), builds the quant config the loader builds, decides
shared-expert fusion, and answers `get_quant_method` for every module the server loads: the format it runs must be
the plan's for every tensor, the moe-TP it derives must be the plan's rollout etp."""

from __future__ import annotations

import functools
import json
import textwrap
from pathlib import Path

import pytest

from oracles.sglang_oracle import SGLangRefused, model_dir_for
from precision_dsl.arch import load_architecture
from precision_dsl.backends import sglang
from precision_dsl.backends.common import UnsupportedByBackend
from precision_dsl.checks import check
from precision_dsl.diagnostics import PolicyError
from precision_dsl.parallel import parse_parallel
from precision_dsl.resolve import resolve

from conftest import DENSE_RECIPES

REPO = Path(__file__).resolve().parents[1]
POLICIES = sorted(p.stem for p in (REPO / "policies").glob("*.policy"))
MODELS = ["tiny-moe", "qwen3-30b-a3b", "deepseek-v3"]
LAYOUTS = {"none": None, "tp8ep8": "rollout:tp=8,ep=8", "tp4ep2pp2": "rollout:tp=4,ep=2,pp=2"}
# DeepSeek-V3 (46k tensors, ~3 s CPU per case) takes the layouts where SGLang decides differently: ep 1 (shared
# experts fusable) and ep > 1 (not); moe-TP > 1 is covered on the two smaller models.
CASES = [(p, m, lay) for p in POLICIES for m in MODELS for lay in LAYOUTS
         if not (m == "deepseek-v3" and lay == "tp4ep2pp2")
         and not (p in DENSE_RECIPES and m != "deepseek-v3")]  # of these, only DeepSeek-V3 has dense MLP layers


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=8)
def plan_of(policy, model, layout):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), parse_parallel(layout))


def plan_kind(t) -> str:
    return t.weight.kind.value if t.is_linear and t.weight.is_quantized else "bf16"


def ask(oracle, plan, tmp_path, server_args=None):
    cfg = sglang.rollout_config(plan)
    arch = arch_of(plan.model)
    return oracle.launch(model_dir_for(plan, arch, tmp_path), cfg.server_args if server_args is None else server_args,
                         cfg.env, arch, plan.target)


def disagreements(plan, launch) -> list[str]:
    by_name = plan.by_name()
    out = [f"{n}: plan {plan_kind(by_name[n])}, SGLang runs {k}" for n, k in launch.kinds.items()
           if plan_kind(by_name[n]) != k]
    return out


@pytest.mark.parametrize("policy,model,layout_id", CASES, ids=["-".join(c) for c in CASES])
def test_sglang_runs_exactly_the_plan(sglang_oracle, policy, model, layout_id, tmp_path):
    layout = LAYOUTS[layout_id]
    try:
        plan = plan_of(policy, model, layout)
    except PolicyError:
        pytest.xfail(f"{policy} does not resolve on {model} (a policy error, reported by `policyc check`)")
    try:
        cfg = sglang.rollout_config(plan)
    except UnsupportedByBackend as err:  # refused by name: tensor + capability, nothing emitted
        assert err.backend == "sglang" and err.tensor and err.capability
        return
    try:
        launch = ask(sglang_oracle, plan, tmp_path)
    except SGLangRefused as err:
        pytest.fail(f"policyc emitted {cfg.server_args} for {policy} on {model}, which SGLang refuses: {err}")
    side = plan.parallel.rollout if plan.parallel else None
    assert launch.resolved["tp_size"] == (side.tp if side else 1)
    assert launch.resolved["pp_size"] == (side.pp if side else 1)
    assert launch.resolved["kv_cache_dtype"] == "bf16"
    assert launch.quant_name == cfg.method
    if any(t.role.startswith("routed_experts.") for t in plan.tensors):
        assert launch.resolved["ep_size"] == (side.ep if side else 1)
        assert launch.moe_tp_size == (side.etp if side else 1), "moe-TP SGLang derives != the plan's rollout etp"
    assert launch.kinds, "SGLang was asked about no module"
    assert len(launch.kinds) == sum(1 for t in plan.tensors if (t.is_linear or t.role == "router.weight")
                                    and t.mtp is None)
    bad = disagreements(plan, launch)
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"
    # the module names policyc gives the tensors (explain, the backend's exclusions) are the ones SGLang loads
    assert sglang.shared_experts_fused(plan) == (launch.shared_experts_fused > 0)
    by_name = plan.by_name()
    named = {n: sglang.serving_prefix(plan, by_name[n]) for n in launch.prefixes}
    wrong = [f"{n}: policyc {named[n]}, SGLang {p}" for n, p in launch.prefixes.items() if named[n] != p]
    assert not wrong, f"{len(wrong)} module names differ, e.g. {wrong[:3]}"
    if any(t.role == "router.weight" and t.weight.kind.value == "fp32" for t in plan.tensors):
        assert launch.hf_overrides["router_fp32"] is True


def test_oracle_catches_shared_expert_fusion_without_the_flag(sglang_oracle, tmp_path):
    """DeepSeek-V3, rollout ep 1: SGLang fuses the (BF16-planned) shared experts into the MXFP8 routed FusedMoE
    unless told not to. The emitter passes --disable-shared-experts-fusion; without it SGLang quantizes them."""
    plan = plan_of("mxfp8-e2e", "deepseek-v3", None)
    args = sglang.rollout_config(plan).server_args
    assert "--disable-shared-experts-fusion" in args
    fused = ask(sglang_oracle, plan, tmp_path, [a for a in args if a != "--disable-shared-experts-fusion"])
    assert fused.shared_experts_fused == 1 and fused.fusion_disabled_reason is None
    bad = disagreements(plan, fused)
    assert bad and all(".mlp.shared_experts." in b and "SGLang runs mxfp8" in b for b in bad)
    routed_quantized = {t.layer for t in plan.tensors if t.role.startswith("routed_experts.") and t.mtp is None
                        and t.weight.is_quantized}
    assert len(bad) == 3 * len(routed_quantized)  # gate/up/down of every layer whose routed experts are MXFP8
    honest = ask(sglang_oracle, plan, tmp_path)
    assert honest.resolved["disable_shared_experts_fusion"] is True and honest.shared_experts_fused == 0
    assert not disagreements(plan, honest)


def test_rollout_etp_is_what_sglang_derives(sglang_oracle, tmp_path):
    """Issue example: trainer etp 1 / ep 8, rollout tp 8 / ep 1. SGLang's moe-TP is tp/ep = 8 (not the etp=1 the
    plan used to assume); per-token scales then differ between trainer and rollout, which `check` reports."""
    layout = "trainer:tp=8,etp=1,ep=8 rollout:tp=8,ep=1"
    assert parse_parallel(layout).rollout.etp == 8
    plan = plan_of("nvfp4-pertoken-hp-backward", "qwen3-30b-a3b", layout)
    codes = {d.code for d in check(plan, arch_of("qwen3-30b-a3b"))}
    assert "etp-mismatch" in codes
    ok = plan_of("mxfp8-e2e", "qwen3-30b-a3b", "rollout:tp=4,ep=1")
    assert ask(sglang_oracle, ok, tmp_path).moe_tp_size == ok.parallel.rollout.etp == 4
    # an explicit etp SGLang cannot see is refused by check and by emit, by name
    bad = plan_of("mxfp8-e2e", "qwen3-30b-a3b", "rollout:tp=8,ep=1,etp=1")
    diags = [d for d in check(bad, arch_of("qwen3-30b-a3b")) if d.code == "rollout-etp"]
    assert diags and "moe_tp = tp/ep = 8/1 = 8" in diags[0].message
    with pytest.raises(UnsupportedByBackend) as ei:
        sglang.rollout_config(bad)
    assert "experts" in ei.value.tensor and "moe_tp" in ei.value.capability


def _plan_text(tmp_path, text, model):
    p = tmp_path / "p.policy"
    p.write_text(textwrap.dedent(text))
    return resolve(p, arch_of(model), None)


def test_fp32_router_reaches_sglang_or_is_refused(sglang_oracle, tmp_path):
    text = 'policy "x" { target blackwell; default bf16; routed_experts: mxfp8 backward=quantized\n router: fp32 }'
    ds = _plan_text(tmp_path, text, "deepseek-v3")
    args = sglang.rollout_config(ds).server_args
    assert args[args.index("--json-model-override-args") + 1] == '{"router_fp32":true}'
    launch = ask(sglang_oracle, ds, tmp_path)
    assert launch.hf_overrides["router_fp32"] is True and not disagreements(ds, launch)
    with pytest.raises(UnsupportedByBackend) as ei:  # Qwen3-MoE: the router is a bf16 ReplicatedLinear
        sglang.rollout_config(_plan_text(tmp_path, text, "qwen3-30b-a3b"))
    assert ei.value.tensor.endswith("mlp.gate.weight") and "router" in ei.value.capability
    lm = 'policy "x" { target blackwell; default bf16; routed_experts: mxfp8 backward=quantized\n lm_head: fp32 }'
    with pytest.raises(UnsupportedByBackend) as ei:
        sglang.rollout_config(_plan_text(tmp_path, lm, "qwen3-30b-a3b"))
    assert ei.value.tensor == "lm_head.weight" and "--enable-fp32-lm-head" in ei.value.capability


def test_sglang_artifacts_carry_the_plan_hash(sglang_oracle, tmp_path):
    plan = plan_of("nvfp4-pertoken-hp-backward", "qwen3-30b-a3b", None)
    arts = {a.path: a.content for a in sglang.emit(plan)}
    h = plan.content_hash()
    assert h not in arts.pop("sglang/launch_args.txt")  # bare argv: `$(cat launch_args.txt)`
    for path, content in arts.items():
        assert h in content, f"{path} lacks the plan hash"
    assert json.loads(arts["sglang/hf_quant_config.json"])["policyc"]["content_hash"] == h
    assert not disagreements(plan, ask(sglang_oracle, plan, tmp_path))  # SGLang still reads the stamped files


@pytest.mark.parametrize("model,text", [
    ("deepseek-v3", 'policy "x" { target blackwell; default bf16; routed_experts: mxfp8 backward=quantized\n'
                    ' router: fp32 }'),  # a JSON word: --json-model-override-args {"router_fp32":true}
    ("qwen3-30b-a3b", None)], ids=["deepseek-v3-json-word", "qwen3-30b-a3b-nvfp4"])
def test_launch_args_txt_is_pasted_whole(sglang_oracle, model, text, tmp_path):
    """`python -m sglang.launch_server --model-path CKPT $(cat launch_args.txt)`: the words the shell hands SGLang
    (no quote removal, no comment line) are the server args, and SGLang's own parser accepts them."""
    from conftest import cat_words

    plan = _plan_text(tmp_path, text, model) if text else plan_of("nvfp4-pertoken-hp-backward", model, None)
    out = tmp_path / "out"
    for a in sglang.emit(plan):
        (out / a.path).parent.mkdir(parents=True, exist_ok=True)
        (out / a.path).write_text(a.content)
    words = cat_words(out / "sglang/launch_args.txt")
    assert words == sglang.rollout_config(plan).server_args
    launch = ask(sglang_oracle, plan, tmp_path, words)  # prepare_server_args(words): argparse exits on a stray word
    assert not disagreements(plan, launch)


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-0.6b", "llama-3.2-1b"])
def test_sglang_runs_the_dense_mxfp8_recipe(sglang_oracle, model, tmp_path):
    """policies/mxfp8-dense.policy on the bundled dense models: SGLang runs every tensor in the plan's format."""
    plan = plan_of("mxfp8-dense", model, None)
    launch = ask(sglang_oracle, plan, tmp_path)
    assert launch.quant_name == sglang.rollout_config(plan).method is not None
    assert not disagreements(plan, launch)
    assert {k for n, k in launch.kinds.items() if plan.by_name()[n].layer == 0} == {"mxfp8"}
    assert all(k == "bf16" for n, k in launch.kinds.items() if plan.by_name()[n].layer is None)


HOPPER_BF16 = 'policy "h" { target hopper; default bf16 }'
HOPPER_FP8_EXPERTS = ('policy "h8" { target hopper; default bf16; routed_experts: fp8_block(scales=fp32)\n'
                      ' shared_experts: fp8_block(scales=fp32) }')


@pytest.mark.parametrize("model,text,layout,fused", [
    ("deepseek-v3", HOPPER_BF16, None, True),
    ("deepseek-v3", HOPPER_BF16, "rollout:tp=8,ep=8", False),  # expert parallelism: SGLang keeps them apart
    ("deepseek-v3", HOPPER_FP8_EXPERTS, None, True),  # one format for shared and routed: no flag, fused
    ("deepseek-v3", 'policy "b" { target blackwell; default bf16 }', None, False),  # auto -> flashinfer_trtllm
    ("glm-4.5-air", HOPPER_BF16, None, True)],
    ids=["dsv3-hopper-bf16", "dsv3-hopper-bf16-ep8", "dsv3-hopper-fp8-experts", "dsv3-blackwell-bf16",
         "glm-hopper-bf16"])
def test_fused_shared_experts_are_named_as_sglang_loads_them(sglang_oracle, model, text, layout, fused, tmp_path):
    """Where SGLang fuses a layer's shared expert into the routed-experts FusedMoE (num_fused_shared_experts),
    policyc names its module `model.layers.N.mlp.experts` (serving_prefix; the IR's sglang_prefix stays the
    unfused module) and `policyc explain` says so: every module name agrees with the one SGLang loads."""
    plan = resolve(_write(tmp_path, text), arch_of(model), parse_parallel(layout))
    launch = ask(sglang_oracle, plan, tmp_path)
    assert (launch.shared_experts_fused > 0) == fused == sglang.shared_experts_fused(plan)
    by_name = plan.by_name()
    wrong = [f"{n}: policyc {sglang.serving_prefix(plan, by_name[n])}, SGLang {p}" for n, p in launch.prefixes.items()
             if sglang.serving_prefix(plan, by_name[n]) != p]
    assert not wrong, f"{len(wrong)} module names differ, e.g. {wrong[:3]}"
    shared = by_name["model.layers.3.mlp.shared_experts.gate_proj.weight"]
    assert shared.sglang_prefix == "model.layers.3.mlp.shared_experts.gate_up_proj"  # the IR: unfused
    assert sglang.serving_prefix(plan, shared) == ("model.layers.3.mlp.experts" if fused else shared.sglang_prefix)
    assert not disagreements(plan, launch)


def _write(tmp_path, text):
    p = tmp_path / "p.policy"
    p.write_text(text)
    return p
