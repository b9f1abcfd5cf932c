"""Resolver: precedence, default semantics, selectors (roles, layers, percent rounding, mtp, name globs), optional,
quantized-on-non-linear, share_scale, imports/extends/cycles, target, plan fields, explain, performance."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.arch.base import Architecture, TensorInfo
from precision_dsl.diagnostics import PolicyError
from precision_dsl.precision import BackwardMode, FormatKind
from precision_dsl.resolve import explain, explain_all, layer_indices, parse_policy, resolve


def hand_arch(num_layers: int = 4, mtp: bool = False, hidden: int = 64) -> Architecture:
    """A small dense model built by hand: per layer q/k/v/o, gate/up/down, two norms; plus embedding, final norm,
    lm_head, and optionally one MTP module (eh_proj, enorm, attn.q) and an fp32 router bias in layer 0."""
    h = hidden
    ts = [TensorInfo(hf_name="model.embed_tokens.weight", shape=(32, h), role="embedding")]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        ts += [
            TensorInfo(hf_name=f"{p}.input_layernorm.weight", shape=(h,), role="norm.input", layer=i),
            TensorInfo(hf_name=f"{p}.self_attn.q_proj.weight", shape=(h, h), role="attn.q", layer=i, fused_group="qkv"),
            TensorInfo(hf_name=f"{p}.self_attn.k_proj.weight", shape=(h, h), role="attn.k", layer=i, fused_group="qkv"),
            TensorInfo(hf_name=f"{p}.self_attn.v_proj.weight", shape=(h, h), role="attn.v", layer=i, fused_group="qkv"),
            TensorInfo(hf_name=f"{p}.self_attn.o_proj.weight", shape=(h, h), role="attn.o", layer=i),
            TensorInfo(hf_name=f"{p}.mlp.gate_proj.weight", shape=(2 * h, h), role="mlp.gate", layer=i,
                       fused_group="gate_up"),
            TensorInfo(hf_name=f"{p}.mlp.up_proj.weight", shape=(2 * h, h), role="mlp.up", layer=i,
                       fused_group="gate_up"),
            TensorInfo(hf_name=f"{p}.mlp.down_proj.weight", shape=(h, 2 * h), role="mlp.down", layer=i),
        ]
    ts.append(TensorInfo(hf_name="model.layers.0.mlp.gate.e_score_correction_bias", shape=(8,), dtype="float32",
                         role="router.bias", layer=0))
    ts += [TensorInfo(hf_name="model.norm.weight", shape=(h,), role="norm.final"),
           TensorInfo(hf_name="lm_head.weight", shape=(32, h), role="lm_head")]
    if mtp:
        p = f"model.layers.{num_layers}"
        ts += [TensorInfo(hf_name=f"{p}.enorm.weight", shape=(h,), role="norm.mtp", mtp=0),
               TensorInfo(hf_name=f"{p}.eh_proj.weight", shape=(h, 2 * h), role="mtp.eh_proj", mtp=0),
               TensorInfo(hf_name=f"{p}.self_attn.q_proj.weight", shape=(h, h), role="attn.q", mtp=0,
                          fused_group="qkv")]
    return Architecture(name=f"hand-{num_layers}", model_type="llama", num_layers=num_layers,
                        num_mtp_layers=1 if mtp else 0, hidden_size=h, config={}, tensors=tuple(ts))


def write(tmp_path: Path, name: str, body: str, pname: str = "t") -> Path:
    f = tmp_path / name
    f.write_text(f'policy "{pname}" {{\n{body}\n}}\n')
    return f


def run(tmp_path, body: str, arch=None, **kw):
    return resolve(write(tmp_path, "p.policy", body), arch or hand_arch(**kw))


def perr(tmp_path, body: str, arch=None, **kw) -> PolicyError:
    with pytest.raises(PolicyError) as ei:
        run(tmp_path, body, arch, **kw)
    return ei.value


def kinds(plan, pred) -> set:
    return {t.weight.kind.value for t in plan.tensors if pred(t)}


# ---- precedence and default ------------------------------------------------------------------------------------------
def test_later_rule_wins_and_overridden_is_recorded(tmp_path):
    plan = run(tmp_path, "    attn: mxfp8\n    attn.q: bf16\n    layers[0].attn: fp8")
    by = plan.by_name()
    q0, q1, k1 = by["model.layers.0.self_attn.q_proj.weight"], by["model.layers.1.self_attn.q_proj.weight"], \
        by["model.layers.1.self_attn.k_proj.weight"]
    assert q0.weight.kind == FormatKind.FP8 and q0.decided_by.line == 4
    assert [r.line for r in q0.overridden] == [2, 3]
    assert q1.weight.kind == FormatKind.BF16 and q1.decided_by.text == "attn.q: bf16"
    assert k1.weight.kind == FormatKind.MXFP8 and q1.overridden[0].text == "attn: mxfp8"


def test_default_is_a_baseline_not_positional(tmp_path):
    plan = run(tmp_path, "    attn: mxfp8\n    default fp8")
    assert kinds(plan, lambda t: t.role.startswith("attn.")) == {"mxfp8"}
    assert kinds(plan, lambda t: t.role.startswith("mlp.")) == {"fp8"}
    assert all(t.decided_by is None for t in plan.tensors if t.role.startswith("mlp."))


def test_no_default_keeps_checkpoint_dtype(tmp_path):
    plan = run(tmp_path, "    optional attn.q: bf16")
    by = plan.by_name()
    assert by["model.layers.0.mlp.gate.e_score_correction_bias"].weight.kind == FormatKind.FP32
    assert by["lm_head.weight"].weight.kind == FormatKind.BF16


def test_default_never_narrows_nonlinear_and_quantized_default_skips_them(tmp_path):
    plan = run(tmp_path, "    default mxfp8")
    by = plan.by_name()
    assert by["model.layers.0.mlp.gate.e_score_correction_bias"].weight.kind == FormatKind.FP32
    assert by["model.norm.weight"].weight.kind == FormatKind.BF16
    assert by["model.embed_tokens.weight"].weight.kind == FormatKind.BF16
    assert by["lm_head.weight"].weight.kind == FormatKind.MXFP8  # linear
    plan = run(tmp_path, "    default fp32")
    assert plan.by_name()["model.norm.weight"].weight.kind == FormatKind.FP32  # widening is allowed
    plan = run(tmp_path, "    default bf16\n    router: bf16")  # an explicit rule may narrow
    assert plan.by_name()["model.layers.0.mlp.gate.e_score_correction_bias"].weight.kind == FormatKind.BF16
    plan = run(tmp_path, '    default bf16\n    name("*.e_score_correction_bias"): bf16')  # so may a name glob
    assert plan.by_name()["model.layers.0.mlp.gate.e_score_correction_bias"].weight.kind == FormatKind.BF16


def test_layer_rules_do_not_narrow_nonlinear_tensors(tmp_path):
    plan = run(tmp_path, "    default mxfp8\n    layers[0]: bf16")
    by = plan.by_name()
    bias = by["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.weight.kind == FormatKind.FP32 and bias.decided_by is None
    norm = by["model.layers.0.input_layernorm.weight"]
    assert norm.weight.kind == FormatKind.BF16 and norm.decided_by.text == "layers[0]: bf16"
    plan = run(tmp_path, "    layers[0]: fp32")  # widening is fine
    assert plan.by_name()["model.layers.0.input_layernorm.weight"].weight.kind == FormatKind.FP32


def test_last_default_and_target_win(tmp_path):
    plan = run(tmp_path, "    default fp8\n    target hopper\n    default bf16\n    target blackwell")
    assert plan.target == "blackwell" and kinds(plan, lambda t: t.is_linear) == {"bf16"}


def test_quantized_rule_on_mixed_selection_keeps_nonlinear(tmp_path):
    plan = run(tmp_path, "    default bf16\n    layers[1]: mxfp8")
    by = plan.by_name()
    assert by["model.layers.1.input_layernorm.weight"].weight.kind == FormatKind.BF16
    assert by["model.layers.1.input_layernorm.weight"].decided_by is None
    assert by["model.layers.1.mlp.up_proj.weight"].weight.kind == FormatKind.MXFP8


def test_quantized_rule_on_nonlinear_only_is_an_error(tmp_path):
    e = perr(tmp_path, "    norm: mxfp8")
    assert e.location.endswith(":2:11") and "no linear weight" in e.message and "bf16 / fp16 / fp32" in e.hint
    plan = run(tmp_path, "    norm: fp32")  # high precision on norms is fine
    assert plan.by_name()["model.norm.weight"].weight.kind == FormatKind.FP32


# ---- selectors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,expected", [(48, list(range(40, 48))), (61, list(range(51, 61))), (4, [3])])
def test_percent_suffix_rounding(n, expected):
    sl = parse_policy('policy "x" { layers[-15%:]: bf16 }').statements[0].selector.layers
    assert layer_indices(sl, n) == expected


@pytest.mark.parametrize("text,n,expected", [
    ("layers[:15%]", 48, list(range(0, 8))),      # stop 7.2 ceiled -> 8
    ("layers[:15%]", 4, [0]),                       # stop 0.6 ceiled -> 1
    ("layers[10%:20%]", 30, [3, 4, 5]),             # exact: 3..6, no float drift
    ("layers[50%:]", 61, list(range(30, 61))),      # start 30.5 floored -> 30
    ("layers[-2:]", 4, [2, 3]),
    ("layers[1:-1]", 4, [1, 2]),
    ("layers[:]", 3, [0, 1, 2]),
    ("layers[0, -1, 50%]", 10, [0, 9, 5]),
    ("layers[3:1]", 4, []),
    ("layers[-100%:]", 5, [0, 1, 2, 3, 4]),
])
def test_layer_slices(text, n, expected):
    sl = parse_policy(f'policy "x" {{ {text}: bf16 }}').statements[0].selector.layers
    assert layer_indices(sl, n) == expected


def test_percent_through_the_resolver_on_48_and_61_layers(tmp_path):
    for n, first in ((48, 40), (61, 51), (4, 3)):
        plan = run(tmp_path, "    default mxfp8\n    layers[-15%:]: bf16", num_layers=n, hidden=32)
        hp_layers = sorted({t.layer for t in plan.tensors if t.is_linear and t.layer is not None
                            and t.weight.kind == FormatKind.BF16})
        assert hp_layers == list(range(first, n))


def test_qwen3_30b_last_15_percent_is_40_to_47(tmp_path):
    arch = load_architecture("qwen3-30b-a3b")
    plan = run(tmp_path, "    default bf16\n    routed_experts: mxfp8\n    layers[-15%:]: bf16", arch)
    hp_layers = sorted({t.layer for t in plan.tensors if t.role.startswith("routed_experts.")
                        and t.weight.kind == FormatKind.BF16})
    assert hp_layers == list(range(40, 48))


def test_layer_index_out_of_range(tmp_path):
    e = perr(tmp_path, "    layers[0, 7]: bf16")
    assert e.location.endswith(":2:15") and "out of range" in e.message and "4 decoder layers" in e.message
    plan = run(tmp_path, "    optional layers[0, 7]: fp8")
    assert kinds(plan, lambda t: t.layer == 0 and t.is_linear) == {"fp8"}


def test_unmatched_rule_is_an_error_unless_optional(tmp_path):
    e = perr(tmp_path, "    shared_experts: bf16")
    assert e.location.endswith(":2:5") and "matches no tensor" in e.message and "optional" in e.hint
    assert "role groups" in e.hint
    run(tmp_path, "    optional shared_experts: bf16")
    e = perr(tmp_path, "    layers[3:1]: bf16")
    assert "decoder layers (0..3)" in e.hint
    e = perr(tmp_path, '    name("nope.*"): bf16')
    assert "no HF tensor name" in e.hint


def test_mtp_scoping(tmp_path):
    arch = hand_arch(mtp=True)
    plan = run(tmp_path, "    default bf16\n    attn: mxfp8", arch)
    by = plan.by_name()
    assert by["model.layers.4.self_attn.q_proj.weight"].weight.kind == FormatKind.BF16  # roles skip MTP
    assert by["model.layers.3.self_attn.q_proj.weight"].weight.kind == FormatKind.MXFP8
    plan = run(tmp_path, "    default bf16\n    mtp.attn: mxfp8\n    mtp.eh_proj: fp8", arch)
    by = plan.by_name()
    assert by["model.layers.4.self_attn.q_proj.weight"].weight.kind == FormatKind.MXFP8
    assert by["model.layers.3.self_attn.q_proj.weight"].weight.kind == FormatKind.BF16
    assert by["model.layers.4.eh_proj.weight"].weight.kind == FormatKind.FP8
    plan = run(tmp_path, "    default mxfp8\n    mtp: bf16", arch)
    assert kinds(plan, lambda t: t.mtp is not None) == {"bf16"}
    assert kinds(plan, lambda t: t.layer == 3 and t.is_linear) == {"mxfp8"}
    # layers[...] never reaches MTP (model.layers.4 is the MTP module, not decoder layer 4)
    plan = run(tmp_path, "    default bf16\n    layers[-1:]: mxfp8", arch)
    assert kinds(plan, lambda t: t.mtp is not None) == {"bf16"}
    e = perr(tmp_path, "    mtp: bf16")  # model without MTP
    assert "0 MTP modules" in e.hint


def test_name_glob_and_conjunction(tmp_path):
    plan = run(tmp_path, '    default bf16\n    name("*.mlp.*_proj.weight"): mxfp8\n'
                         '    layers[1:].name("*.down_proj.weight"): fp8')
    by = plan.by_name()
    assert by["model.layers.0.mlp.down_proj.weight"].weight.kind == FormatKind.MXFP8
    assert by["model.layers.2.mlp.down_proj.weight"].weight.kind == FormatKind.FP8
    assert by["model.layers.2.mlp.up_proj.weight"].weight.kind == FormatKind.MXFP8
    assert by["model.layers.2.self_attn.q_proj.weight"].weight.kind == FormatKind.BF16


def test_member_sets(tmp_path):
    plan = run(tmp_path, "    default bf16\n    attn.{q, o}: mxfp8")
    assert kinds(plan, lambda t: t.role in ("attn.q", "attn.o")) == {"mxfp8"}
    assert kinds(plan, lambda t: t.role in ("attn.k", "attn.v")) == {"bf16"}


# ---- share_scale -----------------------------------------------------------------------------------------------------
def test_share_scale_groups_per_instance(tmp_path):
    plan = run(tmp_path, "    default bf16\n    mlp: nvfp4(act_scale=per_token)\n    share_scale mlp.{gate, up}")
    assert len(plan.share_scale_groups) == 4
    g = plan.share_scale_groups[0]
    assert g.id == "model.layers.0.mlp.{gate_proj,up_proj}"
    assert g.members == ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert g.declared_at.line == 4
    by = plan.by_name()
    gate = by["model.layers.0.mlp.gate_proj.weight"]
    assert gate.share_scale_group == g.id and gate.weight.global_scale == "group"
    assert by["model.layers.0.mlp.down_proj.weight"].weight.global_scale == "tensor"
    assert by["model.layers.0.mlp.down_proj.weight"].share_scale_group is None


def test_share_scale_on_moe_experts():
    arch = load_architecture("tiny-moe")
    plan = resolve(Path(__file__).parents[1] / "policies" / "nvfp4-pertoken-hp-backward.policy", arch)
    # 3 quantized layers (layer 3 is the BF16 15% tail) x 8 experts
    assert len(plan.share_scale_groups) == 3 * 8
    assert plan.share_scale_groups[0].id == "model.layers.0.mlp.experts.0.{gate_proj,up_proj}"


def test_share_scale_errors(tmp_path):
    e = perr(tmp_path, "    default bf16\n    mlp.gate: nvfp4\n    share_scale mlp.{gate, up}")
    assert e.location.endswith(":4:5") and "different formats" in e.message
    assert "model.layers.0.mlp.gate_proj.weight" in e.message and "same rule" in e.hint
    e = perr(tmp_path, "    share_scale mlp.gate")
    assert "single member" in e.message and "{gate, up}" in e.hint
    e = perr(tmp_path, "    share_scale mlp.down")
    assert "no fused siblings" in e.message and e.location.endswith(":2:17")
    e = perr(tmp_path, "    share_scale shared_experts")
    assert "matches no tensor" in e.message
    run(tmp_path, "    optional share_scale shared_experts")


def test_share_scale_without_second_level_scale_is_a_note(tmp_path):
    plan = run(tmp_path, "    default bf16\n    mlp: mxfp8\n    share_scale mlp.{gate, up}")
    assert plan.share_scale_groups == () and any("no second-level" in n for n in plan.notes)


# ---- imports ---------------------------------------------------------------------------------------------------------
def test_import_inlines_at_the_point(tmp_path):
    write(tmp_path, "base.policy", "    attn: bf16\n    default fp8", "base")
    plan = run(tmp_path, '    attn.q: mxfp8\n    import "base.policy"\n    attn.k: mxfp8')
    by = plan.by_name()
    assert by["model.layers.0.self_attn.q_proj.weight"].weight.kind == FormatKind.BF16  # import came later
    assert by["model.layers.0.self_attn.k_proj.weight"].weight.kind == FormatKind.MXFP8
    assert by["model.layers.0.mlp.up_proj.weight"].weight.kind == FormatKind.FP8  # imported default
    assert plan.policy_name == "t" and plan.policy_files[1].endswith("base.policy")
    assert by["model.layers.0.self_attn.q_proj.weight"].decided_by.file.endswith("base.policy")


def test_extends_goes_to_the_top(tmp_path):
    write(tmp_path, "base.policy", "    attn: bf16", "base")
    plan = run(tmp_path, '    attn.q: mxfp8\n    extends "base.policy"')
    assert plan.by_name()["model.layers.0.self_attn.q_proj.weight"].weight.kind == FormatKind.MXFP8


def test_import_relative_to_importer_then_bundled(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    write(sub, "inner.policy", "    attn: fp8", "inner")
    write(sub, "mid.policy", '    import "inner.policy"', "mid")
    plan = run(tmp_path, '    import "sub/mid.policy"\n    import "keep-bf16.policy"',
               arch=load_architecture("tiny-moe"))
    assert plan.policy_files[1].endswith("mid.policy") and plan.policy_files[2].endswith("inner.policy")
    assert plan.policy_files[3].endswith("keep-bf16.policy")  # found in the bundled policies/ dir


def test_import_cycle(tmp_path):
    write(tmp_path, "a.policy", '    import "b.policy"', "a")
    write(tmp_path, "b.policy", '    attn: bf16\n    import "a.policy"', "b")
    with pytest.raises(PolicyError) as ei:
        resolve(tmp_path / "a.policy", hand_arch())
    e = ei.value
    assert "import cycle: a.policy -> b.policy -> a.policy" in e.message
    assert e.location.endswith("b.policy:3:5") and "imported from" in e.render() and "hint:" in e.render()
    write(tmp_path, "self.policy", '    import "self.policy"', "s")
    with pytest.raises(PolicyError, match="import cycle"):
        resolve(tmp_path / "self.policy", hand_arch())


def test_missing_import_and_errors_inside_imports(tmp_path):
    e = perr(tmp_path, '    import "nope.policy"')
    assert e.location.endswith("p.policy:2:5") and "cannot find" in e.message and "shipped policy name" in e.hint
    write(tmp_path, "bad.policy", "    attn: nvfp5", "bad")
    e = perr(tmp_path, '    import "bad.policy"')
    assert e.location.endswith("bad.policy:2:11") and "nvfp5" in e.render().splitlines()[1]
    assert any("imported from" in n and "p.policy:2:5" in n for n in e.notes)
    write(tmp_path, "syntax.policy", "    attn bf16", "syn")
    e = perr(tmp_path, '    import "syntax.policy"')
    assert e.location.endswith("syntax.policy:2:10") and "imported from" in e.render()


def test_missing_root_file(tmp_path):
    with pytest.raises(PolicyError) as ei:
        resolve(tmp_path / "missing.policy", hand_arch())
    assert "not found" in ei.value.render() and "shipped policy name" in ei.value.hint


# ---- target ----------------------------------------------------------------------------------------------------------
def test_target_hopper_rejects_blackwell_formats(tmp_path):
    e = perr(tmp_path, "    target hopper\n    attn: mxfp8")
    assert e.location.endswith(":3:11") and "Blackwell" in e.message and "emulate" in e.hint
    assert any("target set at" in n for n in e.notes)
    plan = run(tmp_path, "    target hopper emulate\n    attn: mxfp8")
    assert plan.emulate and any("emulation" in n for n in plan.notes)
    plan = run(tmp_path, "    target hopper\n    attn: fp8_block")
    assert plan.target == "hopper" and not plan.emulate and plan.notes == ()


def test_format_error_in_a_rule_points_at_the_argument(tmp_path):
    e = perr(tmp_path, "    attn: nvfp4(act_scale=per_tokn)")
    assert e.location.endswith(":2:17") and "per_token" in e.hint
    assert e.render().splitlines()[2].count("^") == len("act_scale=per_tokn")


# ---- plan fields -----------------------------------------------------------------------------------------------------
def test_plan_fields_and_bytes(tmp_path):
    arch = load_architecture("tiny-moe")
    plan = run(tmp_path, "    default bf16\n    routed_experts: nvfp4\n    attn: mxfp8\n    attn.o: fp8_block", arch)
    assert len(plan.tensors) == len(arch.tensors) and plan.model == "tiny-moe" and plan.num_layers == 4
    assert [t.hf_name for t in plan.tensors] == [t.hf_name for t in arch.tensors]
    info = arch.by_name()
    for t in plan.tensors:
        src = info[t.hf_name]
        assert (t.megatron_name, t.sglang_prefix, t.layer, t.role, t.shape) == \
            (src.megatron_name, src.sglang_prefix, src.layer, src.role, src.shape)
        assert t.bytes_before == math.prod(src.shape) * 2
    by = plan.by_name()
    e = by["model.layers.0.mlp.experts.0.gate_proj.weight"]  # [128, 128] nvfp4: 4 bits + e4m3 per 16 + fp32
    assert e.bytes_after == 128 * 128 // 2 + 128 * 128 // 16 + 4
    q = by["model.layers.0.self_attn.q_proj.weight"]  # [128, 128] mxfp8: 8 bits + e8m0 per 32
    assert q.bytes_after == 128 * 128 + 128 * 128 // 32
    o = by["model.layers.0.self_attn.o_proj.weight"]  # fp8_block 128x128 tile, fp32 scale
    assert o.bytes_after == 128 * 128 + 4
    n = by["model.norm.weight"]
    assert n.bytes_after == n.bytes_before and not n.is_linear
    Plan = type(plan)
    again = Plan.from_json(plan.to_json())  # model_construct output round-trips through validation
    assert again.content_hash() == plan.content_hash()


def test_parsed_policy_object_is_accepted(tmp_path):
    pol = parse_policy('policy "obj" { default fp8 }', str(tmp_path / "x.policy"))
    plan = resolve(pol, hand_arch())
    assert plan.policy_name == "obj" and kinds(plan, lambda t: t.is_linear) == {"fp8"}


# ---- explain ---------------------------------------------------------------------------------------------------------
def test_explain_chain(tmp_path):
    f = write(tmp_path, "p.policy", "    default bf16\n    attn: mxfp8\n    layers[0].attn.q: fp8\n    mlp: fp8")
    steps = explain(f, hand_arch(), "model.layers.0.self_attn.q_proj.weight")
    assert [(s[0].line if s[0] else None, s[1].weight.kind.value, s[2]) for s in steps] == \
        [(2, "bf16", False), (3, "mxfp8", False), (4, "fp8", True)]
    assert steps[0][0].text == "default bf16"
    steps = explain(f, hand_arch(), "model.norm.weight")
    assert len(steps) == 1 and steps[0][2] and steps[0][1].weight.kind == FormatKind.BF16
    many = explain_all(f, hand_arch(), "model.layers.*.self_attn.k_proj.weight")
    assert list(many) == [f"model.layers.{i}.self_attn.k_proj.weight" for i in range(4)]
    assert all(sum(w for _, _, w in s) == 1 for s in many.values())
    with pytest.raises(PolicyError) as ei:
        explain(f, hand_arch(), "model.layers.0.self_attn.q_prj.weight")
    assert "q_proj" in ei.value.hint


def test_explain_reflects_share_scale(tmp_path):
    f = write(tmp_path, "p.policy", "    mlp: nvfp4\n    share_scale mlp.{gate, up}")
    steps = explain(f, hand_arch(), "model.layers.0.mlp.up_proj.weight")
    assert steps[-1][2] and steps[-1][1].weight.global_scale == "group" and steps[0][0] is None


# ---- performance -----------------------------------------------------------------------------------------------------
def test_deepseek_v3_resolve_is_fast():
    arch = load_architecture("deepseek-v3")
    policy = Path(__file__).parents[1] / "policies" / "miles-nvfp4.policy"
    resolve(policy, arch)  # warm (grammar compile, caches)
    best = math.inf
    for _ in range(3):
        t0 = time.process_time()
        plan = resolve(policy, arch)
        best = min(best, time.process_time() - t0)
    assert len(plan.tensors) == len(arch.tensors) > 45_000
    # Measured (min of 3): 0.28 s CPU on the 2-core box loaded by other jobs (load average 3), with TensorPlans built
    # by the checked unvalidated constructor, share groups keyed by fused instance and the GC paused while building;
    # a pydantic model_copy per TensorPlan with O(members) share-group lookups took 1.18 s. The bound allows ~2x for
    # a loaded machine, not a return to 1 s.
    assert best < 0.6, f"resolve took {best:.3f} s CPU"


def test_tensor_plans_are_the_objects_model_construct_builds():
    """resolve builds TensorPlans without per-object validation (plan.new_tensor_plan); they must equal what
    pydantic's model_construct and full validation produce, or the constructor must have fallen back to it."""
    from precision_dsl.plan import TensorPlan, new_tensor_plan

    arch = load_architecture("deepseek-v3")
    plan = resolve(Path(__file__).parents[1] / "policies" / "nvfp4-pertoken-dequant-backward.policy", arch)
    for t in plan.tensors[::997]:
        assert TensorPlan.model_construct(**dict(t)) == t
        assert TensorPlan.model_validate(t.model_dump()) == t
        assert t.model_fields_set == set(TensorPlan.model_fields) and list(t.__dict__) == list(TensorPlan.model_fields)
        assert t.model_copy(update={"layer": 7}).layer == 7 and t.model_fields_set == set(TensorPlan.model_fields)
    assert new_tensor_plan.__name__ == "construct_unvalidated"  # pydantic internals still match; else it falls back


def test_decided_by_default_and_backward(tmp_path):
    plan = run(tmp_path, "    default mxfp8 backward=dequantized")
    t = plan.by_name()["model.layers.0.mlp.up_proj.weight"]
    assert t.decided_by is None and t.backward == BackwardMode.DEQUANTIZED
    assert isinstance(plan.tensors[0].precision.weight.kind, FormatKind)


def test_hopper_default_with_blackwell_format_points_at_default(tmp_path):
    e = perr(tmp_path, "    target hopper\n    default nvfp4")
    assert e.location.endswith(":3:13") and "nvfp4 runs natively only on Blackwell" in e.message


def test_directory_as_policy_is_a_clean_error(tmp_path):
    with pytest.raises(PolicyError) as ei:
        resolve(tmp_path, hand_arch())
    assert "cannot read" in ei.value.render()
