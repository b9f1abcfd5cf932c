"""Static checks on resolved plans: every check fires on a crafted model/layout and stays quiet on a good one."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.arch.base import Architecture, TensorInfo
from precision_dsl.checks import check, check_fused_siblings, check_hardware, check_share_scale
from precision_dsl.plan import ParallelLayout, ParallelSide, ShareScaleGroup
from precision_dsl.precision import Precision
from precision_dsl.resolve import resolve

POLICIES = Path(__file__).parents[1] / "policies"


def moe_arch(n_layers: int = 4, hidden: int = 64, inter: int = 96, experts: int = 2, kv_heads: int = 2) -> Architecture:
    """Hand-built MoE: attention q/k/v/o + routed experts gate/up/down with chosen dims."""
    ts = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        ts += [TensorInfo(hf_name=f"{p}.input_layernorm.weight", shape=(hidden,), role="norm.input", layer=i),
               TensorInfo(hf_name=f"{p}.self_attn.q_proj.weight", shape=(hidden, hidden), role="attn.q", layer=i,
                          fused_group="qkv"),
               TensorInfo(hf_name=f"{p}.self_attn.k_proj.weight", shape=(hidden // 2, hidden), role="attn.k",
                          layer=i, fused_group="qkv"),
               TensorInfo(hf_name=f"{p}.self_attn.v_proj.weight", shape=(hidden // 2, hidden), role="attn.v",
                          layer=i, fused_group="qkv"),
               TensorInfo(hf_name=f"{p}.self_attn.o_proj.weight", shape=(hidden, hidden), role="attn.o", layer=i)]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            ts += [TensorInfo(hf_name=f"{q}.gate_proj.weight", shape=(inter, hidden), role="routed_experts.gate",
                              layer=i, expert=e, fused_group="experts.gate_up"),
                   TensorInfo(hf_name=f"{q}.up_proj.weight", shape=(inter, hidden), role="routed_experts.up",
                              layer=i, expert=e, fused_group="experts.gate_up"),
                   TensorInfo(hf_name=f"{q}.down_proj.weight", shape=(hidden, inter), role="routed_experts.down",
                              layer=i, expert=e)]
    return Architecture(name="hand-moe", model_type="qwen3_moe", num_layers=n_layers, num_experts=experts,
                        hidden_size=hidden, config={"num_key_value_heads": kv_heads, "num_attention_heads": 4},
                        tensors=tuple(ts))


def plan_for(tmp_path, body: str, arch: Architecture):
    f = tmp_path / "p.policy"
    f.write_text('policy "c" {\n' + body + "\n}\n")
    return resolve(f, arch)


def codes(diags) -> list[str]:
    return sorted(d.code for d in diags)


def layout(ttp=1, tetp=1, tpp=1, rtp=1, retp=1) -> ParallelLayout:
    # SGLang derives the rollout expert TP as tp / ep (check rollout-etp): pick the rollout tp/ep that give retp
    tp = max(rtp, retp)
    return ParallelLayout(trainer=ParallelSide(tp=ttp, etp=tetp, pp=tpp),
                          rollout=ParallelSide(tp=tp, etp=retp, ep=tp // retp))


def test_clean_plan_has_no_diagnostics(tmp_path):
    arch = moe_arch(hidden=128, inter=128)
    plan = plan_for(tmp_path, "    default bf16\n    routed_experts: mxfp8\n    attn: mxfp8", arch)
    assert check(plan, arch) == []
    assert check(plan, arch, layout(ttp=2, tetp=2, rtp=2, retp=2)) == []


def test_mxfp8_divisibility_whole_tensor(tmp_path):
    arch = moe_arch(hidden=64, inter=48)  # experts [48, 64]: N=48 not % 32; down [64, 48]: K=48 not % 32
    plan = plan_for(tmp_path, "    routed_experts: mxfp8", arch)
    diags = check(plan, arch)
    assert codes(diags) == ["block-divisibility"] * 3
    msgs = "\n".join(d.message for d in diags)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in msgs and "N=48 is not a multiple of 32" in msgs
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in msgs and "K=48 is not a multiple of 32" in msgs
    assert "(and 7 more tensors like it)" in msgs  # 4 layers x 2 experts, reported once
    assert all(d.severity == "error" and d.hint and d.tensor for d in diags)


def test_nvfp4_divisibility_and_16x16(tmp_path):
    arch = moe_arch(hidden=64, inter=40)  # down K=40 not % 16; gate/up N=40 only matters for 16x16
    plan = plan_for(tmp_path, "    routed_experts: nvfp4\n    share_scale routed_experts.{gate, up}", arch)
    msgs = [d.message for d in check(plan, arch)]
    assert len(msgs) == 1 and "down_proj" in msgs[0] and "K=40 is not a multiple of 16" in msgs[0]
    plan = plan_for(tmp_path, "    routed_experts.{gate, up}: weight=nvfp4(weight_block=16x16), act=bf16", arch)
    msgs = [d.message for d in check(plan, arch)]
    assert any("N=40 is not a multiple of 16 (NVFP4 16x16" in m and "gate_proj" in m for m in msgs)


def test_fp8_block_allows_partial_blocks_but_not_cut_shards(tmp_path):
    arch = moe_arch(hidden=256, inter=192)
    plan = plan_for(tmp_path, "    target hopper\n    routed_experts: fp8_block", arch)
    assert check(plan, arch) == []  # 192 rows = 1.5 blocks: partial tiles are fine
    diags = check(plan, arch, layout(tetp=2, retp=2))  # 192/2 = 96 rows per shard: cuts a 128-row tile
    assert diags and all(d.code == "block-divisibility" for d in diags)
    assert any("shard N=96 cuts a 128-row FP8 block" in d.message and "gate_proj" in d.message for d in diags)
    assert any("trainer" in d.message for d in diags) and any("rollout" in d.message for d in diags)


def test_tp_shards_column_and_row_parallel(tmp_path):
    arch = moe_arch(hidden=128, inter=128, kv_heads=2)
    plan = plan_for(tmp_path, "    attn: mxfp8", arch)
    diags = check(plan, arch, layout(ttp=8))  # q: 128/8 = 16 rows; o: K 128/8 = 16; k/v replicate beyond 2 heads
    msgs = "\n".join(d.message for d in diags)
    assert "q_proj" in msgs and "N=16 is not a multiple of 32" in msgs and "trainer shard [16, 128] (tp=8)" in msgs
    assert "o_proj" in msgs and "K=16 is not a multiple of 32" in msgs
    assert "k_proj" not in msgs  # 64 rows / min(tp, kv_heads)=2 -> 32: fine
    diags = check(plan, arch, layout(rtp=3))
    assert any("does not split evenly over rollout tp=3" in d.message for d in diags)


def test_fused_siblings_must_agree(tmp_path):
    arch = moe_arch(hidden=64, inter=64)
    plan = plan_for(tmp_path, "    attn.q: mxfp8\n    routed_experts.gate: nvfp4", arch)
    diags = check_fused_siblings(plan)
    assert codes(diags) == ["fused-siblings", "fused-siblings"]
    msgs = "\n".join(d.message for d in diags)
    assert "model.layers.0.self_attn.q_proj.weight is mxfp8" in msgs.replace(": is", " is")
    assert "fused sibling model.layers.0.self_attn.k_proj.weight" in msgs
    assert "experts.0.gate_proj.weight" in msgs and "experts.0.up_proj.weight" in msgs
    assert all("{gate, up}" in d.hint for d in diags)
    ok = plan_for(tmp_path, "    attn.{q, k, v}: mxfp8\n    routed_experts: nvfp4\n"
                            "    share_scale routed_experts.{gate, up}", arch)
    assert check_fused_siblings(ok) == []


def test_unshared_second_level_scales_on_fused_siblings_warn(tmp_path):
    arch = moe_arch(hidden=64, inter=64)
    plan = plan_for(tmp_path, "    routed_experts: nvfp4\n    attn: fp8", arch)
    diags = check_fused_siblings(plan)
    assert codes(diags) == ["share-scale-missing", "share-scale-missing"]
    assert all(d.severity == "warning" for d in diags)
    hints = sorted(d.hint for d in diags)
    assert "share_scale attn.{q, k, v}" in hints[0] and "share_scale routed_experts.{gate, up}" in hints[1]
    assert any("model.layers.0.mlp.experts.0.gate_proj.weight" in d.message for d in diags)


def test_share_scale_check_on_a_tampered_plan(tmp_path):
    arch = moe_arch(hidden=64, inter=64)
    plan = plan_for(tmp_path, "    routed_experts: nvfp4\n    share_scale routed_experts.{gate, up}", arch)
    assert check_share_scale(plan) == []
    # a plan edited by hand (or produced by another tool): members disagree / lost the group scale / unknown member
    tensors = list(plan.tensors)
    i = next(k for k, t in enumerate(tensors) if t.hf_name.endswith("experts.0.up_proj.weight"))
    tensors[i] = tensors[i].model_copy(update={"precision": Precision.high()})
    bad = plan.model_copy(update={"tensors": tuple(tensors)})
    diags = check_share_scale(bad)
    assert len(diags) == 1 and "model.layers.0.mlp.experts.0.gate_proj.weight" in diags[0].message
    assert "same share-scale group" in diags[0].message
    ghost = plan.model_copy(update={"share_scale_groups": plan.share_scale_groups + (
        ShareScaleGroup(id="x", members=("nope.weight", "model.layers.0.self_attn.q_proj.weight")),)})
    assert any("nope.weight" in d.message for d in check_share_scale(ghost))
    g0 = plan.share_scale_groups[0]
    j = next(k for k, t in enumerate(plan.tensors) if t.hf_name == g0.members[0])
    k2 = next(k for k, t in enumerate(plan.tensors) if t.hf_name == g0.members[1])
    raw = plan_for(tmp_path, "    routed_experts: nvfp4", arch)  # same formats without the group scale
    tensors = list(plan.tensors)
    tensors[j], tensors[k2] = raw.tensors[j], raw.tensors[k2]
    nogroup = plan.model_copy(update={"tensors": tuple(tensors)})
    assert any("does not use a group scale" in d.message for d in check_share_scale(nogroup))


def test_hardware_check(tmp_path):
    arch = moe_arch(hidden=64, inter=64)
    plan = plan_for(tmp_path, "    routed_experts: nvfp4\n    attn: mxfp8", arch)
    assert check_hardware(plan) == []  # blackwell
    hopper = plan.model_copy(update={"target": "hopper"})
    diags = check_hardware(hopper)
    assert sorted(d.message.split(": ", 1)[1].split()[0] for d in diags) == ["mxfp8", "nvfp4"]
    assert all(d.severity == "error" and "emulate" in d.hint for d in diags)
    assert check_hardware(hopper.model_copy(update={"emulate": True})) == []


def test_etp_must_match_for_per_token_scales(tmp_path):
    arch = moe_arch(hidden=64, inter=64)
    plan = plan_for(tmp_path, "    routed_experts: nvfp4(act_scale=per_token)\n    share_scale routed_experts.{gate, up}",
                    arch)
    diags = [d for d in check(plan, arch, layout(tetp=2, retp=1)) if d.code == "etp-mismatch"]
    assert len(diags) == 1 and "trainer etp=2 and rollout etp=1" in diags[0].message
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in diags[0].message
    assert not [d for d in check(plan, arch, layout(tetp=2, retp=2)) if d.code == "etp-mismatch"]
    per_tensor = plan_for(tmp_path, "    routed_experts: nvfp4", arch)
    assert not [d for d in check(per_tensor, arch, layout(tetp=2, retp=1)) if d.code == "etp-mismatch"]


def test_pipeline_bf16_runs_are_the_megatron_emitters_and_reach_check_through_the_gate(tmp_path):
    from precision_dsl.engine.gate import run_gate
    from precision_dsl.arch import load_architecture

    arch = load_architecture("tiny-moe")  # 4 layers
    plan = plan_for(tmp_path, "    attn: mxfp8 backward=quantized\n    routed_experts: mxfp8 backward=quantized\n"
                              "    layers[-2:]: bf16", arch)
    assert run_gate(plan.model_copy(update={"parallel": layout(tpp=2)}), arch, ["megatron"]).ok()  # 2 <= 4 // 2
    # pp=4: one layer per stage; --num-layers-at-end-in-bf16 stops at 1, so layer 2 (local layer 0 of stage 2) must
    # be BF16 by the TE file while local layer 0 of stages 0/1 is mxfp8: one file for every rank cannot say that
    res = run_gate(plan.model_copy(update={"parallel": layout(tpp=4)}), arch, ["megatron"])
    errs = res.errors()
    assert errs and all(d.code == "unsupported-by-megatron" for d in errs)
    assert "model.layers.2." in errs[0].message and "stage-local" in errs[0].message


def test_scale_scope_warning(tmp_path):
    arch = moe_arch(hidden=64, inter=64)
    plan = plan_for(tmp_path, "    attn: weight=nvfp4(weight_scale=per_expert), act=bf16\n"
                              "    share_scale attn.{q, k, v}", arch)
    diags = check(plan, arch)
    assert codes(diags) == ["scale-scope"] and diags[0].severity == "warning"


@pytest.mark.parametrize("policy", ["nvfp4-pertoken-hp-backward.policy", "mxfp8-e2e.policy",
                                    "fp8-blockwise-hopper.policy"])
def test_shipped_policies_pass_checks_on_qwen3_30b(policy):
    arch = load_architecture("qwen3-30b-a3b")
    plan = resolve(POLICIES / policy, arch)
    par = layout(ttp=4, tetp=1, tpp=1, rtp=4, retp=1)
    assert [d for d in check(plan, arch, par) if d.severity == "error"] == []
