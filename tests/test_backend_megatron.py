"""backends/megatron.py, validated by megatron-core 0.16.1 itself:

* the emitted flags build a TransformerConfig (MLATransformerConfig for DeepSeek-V3) without validation errors, the
  YAML loads with megatron-core's loader, and every TE module read per pipeline rank by megatron-core's own matcher
  runs the plan's format (tests/megatron_oracle.py; the full matrix is tests/test_megatron_oracle.py);
* layer-specific rules, uneven pipeline splits, MTP under FP4, fp32 exceptions and TE versions;
* plans the trainer cannot run exactly raise UnsupportedByBackend naming the tensor and the missing capability.
"""

from __future__ import annotations

import functools
import re
import textwrap
from pathlib import Path

import pytest

import megatron.core  # noqa: E402,F401  (the oracle; in the test extra: missing must fail, not skip)

from precision_dsl.backends import megatron as mg  # noqa: E402
from precision_dsl.backends.common import UnsupportedByBackend  # noqa: E402
from precision_dsl.arch import load_architecture  # noqa: E402
from precision_dsl.parallel import parse_parallel  # noqa: E402
from precision_dsl.resolve import resolve  # noqa: E402

from conftest import SEED_POLICIES, cat_words  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEEDS = SEED_POLICIES
@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=None)
def plan_of(policy, model, parallel=None):
    path = Path(policy) if Path(policy).is_file() else REPO / "policies" / f"{policy}.policy"
    return resolve(path, arch_of(model), parse_parallel(parallel))


def check_plan_against_megatron(plan, arch, tmp_path):
    """Emit, build megatron-core's TransformerConfig from the flags, and read every TE module through
    megatron-core's matcher per pipeline rank (tests/megatron_oracle.py); all must be the plan's format."""
    import megatron_oracle as mo

    arts = {a.path: a for a in mg.emit(plan)}
    flags = mg.read_args(arts["megatron/args.txt"].content)
    for p, a in arts.items():
        if p.endswith(".yaml"):
            (tmp_path / Path(p).name).write_text(a.content)
    config = mo.build_config(arch, flags, tmp_path)
    expected = {m: ts[0].weight.kind.value if ts[0].weight.is_quantized else "bf16"
                for m, ts in mo.plan_modules(plan).items()}
    assert expected, "no TE modules found"
    got = {m: r.kind for m, (_, r) in mo.read_modules(config, sorted(expected)).items()}
    wrong = {m: (got[m], expected[m]) for m in expected if got[m] != expected[m]}
    assert not wrong, f"modules resolving to the wrong format (got, plan): {dict(list(wrong.items())[:5])}"
    return arts, flags


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", ["tiny-moe", "qwen3-30b-a3b"])
def test_seed_policies_validate_in_megatron_core(seed, model, tmp_path):
    plan = plan_of(seed, model)
    arts, flags = check_plan_against_megatron(plan, arch_of(model), tmp_path)
    env = arts["megatron/env.sh"].content
    assert plan.content_hash() in env and plan.content_hash() in arts["megatron/flags.json"].content
    assert "--moe-grouped-gemm" in flags  # the YAML globs name TEGroupedLinear modules
    if seed == "bf16":
        assert "--fp8-format" not in flags and "--fp4-format" not in flags
    if seed.startswith("mxfp8"):
        assert flags[flags.index("--fp8-recipe") + 1] == "mxfp8"
    if seed.startswith("nvfp4"):
        assert flags[flags.index("--fp4-format") + 1] == "e2m1" and "--fp8-format" not in flags
        for var in ("NVTE_NVFP4_DISABLE_RHT=1", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1",
                    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1", "NVTE_NVFP4_ROW_SCALED_ACTIVATION=1"):
            assert f"export {var}" in env
        assert "unset NVTE_USE_FAST_MATH" in env  # read by TE's C++ quantizer; its default is the exact one
    if seed.endswith("hp-backward"):
        assert "NVTE_BACKWARD_OVERRIDE=high_precision" in env
    if seed.endswith("dequant-backward"):
        assert "NVTE_BACKWARD_OVERRIDE=dequantized" in env
    if seed == "mxfp8-e2e":
        assert "NVTE_BACKWARD_OVERRIDE" not in env


@pytest.mark.parametrize("seed", ["mxfp8-e2e", "nvfp4-pertoken-dequant-backward"])
def test_deepseek_mla_config_and_every_module(seed, tmp_path):
    plan = plan_of(seed, "deepseek-v3")
    arts, flags = check_plan_against_megatron(plan, arch_of("deepseek-v3"), tmp_path)
    yaml_text = arts["megatron/te_precision.yaml"].content
    assert "linear_kv_up_proj" not in yaml_text  # kv_b stays bf16 through the catch-all, never matched as quantized


def test_first_last_counts_are_explicit_and_global(tmp_path):
    # keep-bf16: layers[-15%:] of 48 layers -> the last 8 (40..47) BF16
    plan = plan_of("mxfp8-e2e", "qwen3-30b-a3b")
    _, flags = check_plan_against_megatron(plan, arch_of("qwen3-30b-a3b"), tmp_path)
    assert flags[flags.index("--num-layers-at-start-in-bf16") + 1] == "0"
    end = int(flags[flags.index("--num-layers-at-end-in-bf16") + 1])
    assert end == sum(1 for i in range(48) if all(not t.weight.is_quantized for t in plan.tensors if t.layer == i))


def _write_policy(tmp_path, body: str) -> Path:
    p = tmp_path / "p.policy"
    p.write_text(textwrap.dedent(body))
    return p


LAYER_SPECIFIC = """
policy "mid" {
    target blackwell
    default bf16
    attn: mxfp8 backward=quantized
    routed_experts: mxfp8 backward=quantized
    layers[1].attn: bf16
    layers[2].routed_experts: fp8_block(scales=fp32) backward=quantized
}
"""


def test_layer_specific_plan_without_pp_uses_global_indices(tmp_path):
    plan = resolve(_write_policy(tmp_path, LAYER_SPECIFIC), arch_of("tiny-moe"), None)
    arts, flags = check_plan_against_megatron(plan, arch_of("tiny-moe"), tmp_path)
    assert [p for p in arts if p.endswith(".yaml")] == ["megatron/te_precision.yaml"]
    assert "decoder.layers.2.mlp.experts.linear_fc1" in arts["megatron/te_precision.yaml"].content
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in arts["megatron/env.sh"].content


PERIODIC = """
policy "periodic" {
    target blackwell
    default bf16
    attn: mxfp8 backward=quantized
    routed_experts: mxfp8 backward=quantized
    layers[1].attn: bf16
    layers[3].routed_experts: fp8_block(scales=fp32) backward=quantized
    layers[1].routed_experts: fp8_block(scales=fp32) backward=quantized
}
"""


def test_layer_specific_rule_that_repeats_per_stage_is_one_file_for_every_rank(tmp_path):
    # pp=2 on 4 layers: stage 0 = layers 0,1, stage 1 = layers 2,3; attn bf16 only on global 1 -> local 1 on
    # stage 0 but global 3 (local 1 on stage 1) is mxfp8: refused. Experts fp8_block on 1 and 3 = local 1 on both.
    ok = PERIODIC.replace("    layers[1].attn: bf16\n", "")
    plan = resolve(_write_policy(tmp_path, ok), arch_of("tiny-moe"), parse_parallel("trainer:pp=2"))
    arts, flags = check_plan_against_megatron(plan, arch_of("tiny-moe"), tmp_path)
    text = arts["megatron/te_precision.yaml"].content
    assert "decoder.layers.1.mlp.experts.linear_fc1" in text and "decoder.layers.3." not in text
    assert "--te-precision-config-file" in flags and "stage" not in " ".join(flags)


def test_layer_specific_rule_that_differs_per_stage_is_refused_by_name(tmp_path):
    plan = resolve(_write_policy(tmp_path, PERIODIC), arch_of("tiny-moe"), parse_parallel("trainer:pp=2"))
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan)
    assert ei.value.tensor.startswith("model.layers.3.self_attn."), ei.value.tensor
    assert "stage-local" in ei.value.capability and "every rank gets the same file" in ei.value.capability


def test_layer_agnostic_plan_emits_single_yaml_under_pp(tmp_path):
    plan = plan_of("mxfp8-hp-backward", "tiny-moe", "trainer:pp=2")
    arts, _ = check_plan_against_megatron(plan, arch_of("tiny-moe"), tmp_path)
    yamls = [p for p in arts if p.endswith(".yaml")]
    assert yamls == ["megatron/te_precision.yaml"]
    assert re.search(r"decoder\.layers\.\d", arts[yamls[0]].content) is None


@pytest.mark.parametrize("layers,pp,split", [(61, 4, (16, 15)), (94, 3, (32, 31)), (48, 5, (11, 10)), (4, 3, (2, 1)),
                                             (5, 2, (3, 2)), (48, 4, None)])
def test_uneven_pipeline_split_is_one_megatron_core_accepts(layers, pp, split):
    assert mg.pipeline_split(layers, pp) == split
    ranges = mg.stage_ranges(layers, pp)
    assert sum(len(r) for r in ranges) == layers and ranges[0].start == 0 and ranges[-1].stop == layers
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


def test_uneven_pipeline_flags_pass_megatron_core(tmp_path):
    plan = plan_of("mxfp8-hp-backward", "qwen3-30b-a3b", "trainer:pp=5")
    arts, flags = check_plan_against_megatron(plan, arch_of("qwen3-30b-a3b"), tmp_path)
    assert flags[flags.index("--decoder-first-pipeline-num-layers") + 1] == "11"
    assert flags[flags.index("--decoder-last-pipeline-num-layers") + 1] == "10"


def test_mtp_under_fp4_is_refused_by_name(tmp_path):
    body = """
    policy "x" { target blackwell; default bf16
                 routed_experts: nvfp4(act_scale=per_token) backward=high_precision
                 share_scale routed_experts.{gate, up}
                 mtp.routed_experts: nvfp4(act_scale=per_token) backward=high_precision }
    """
    plan = resolve(_write_policy(tmp_path, body), arch_of("deepseek-v3"), None)
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan)
    assert "MTP" in str(ei.value) and "FP4" in str(ei.value)


def test_router_fp32_is_a_megatron_flag_and_other_fp32_is_refused(tmp_path):
    import megatron_oracle as mo

    plan = resolve(_write_policy(tmp_path, """
    policy "x" { target blackwell; default bf16; routed_experts: mxfp8 backward=quantized; router: fp32 }
    """), arch_of("qwen3-30b-a3b"), None)
    arts, flags = check_plan_against_megatron(plan, arch_of("qwen3-30b-a3b"), tmp_path)
    assert flags[flags.index("--moe-router-dtype") + 1] == "fp32"
    assert mo.build_config(arch_of("qwen3-30b-a3b"), flags, tmp_path).moe_router_dtype == "fp32"
    plan = resolve(_write_policy(tmp_path, """
    policy "x" { target blackwell; default bf16; routed_experts: mxfp8 backward=quantized; lm_head: fp32
                 embedding: fp32 }
    """), arch_of("qwen3-30b-a3b"), None)
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan)
    errs = getattr(ei.value, "errors", [ei.value])
    assert {e.tensor for e in errs} == {"lm_head.weight", "model.embed_tokens.weight"}, [str(e) for e in errs]
    assert all("fp32" in e.capability for e in errs)


def test_problems_are_collected_not_first_only(tmp_path):
    body = """
    policy "x" { target blackwell; default bf16; attn.q: mxfp8 backward=quantized; lm_head: mxfp8 backward=quantized
                 norm: fp32 }
    """
    plan = resolve(_write_policy(tmp_path, body), arch_of("tiny-moe"), None)
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan)
    caps = " | ".join(e.capability for e in ei.value.errors)
    assert "runs one TE recipe" in caps and "not a TransformerEngine module" in caps and "fp32 norm" in caps


@pytest.mark.parametrize("policy,te,needs", [
    ("mxfp8-hp-backward", "2.14.0", "NVTE_BACKWARD_OVERRIDE"),
    ("nvfp4-pertoken-hp-backward", "2.15.1", "NVTE_NVFP4_ROW_SCALED_ACTIVATION"),
    ("mxfp8-dequant-backward", "2.17.0", "save_original_input"),
])
def test_older_te_is_refused_naming_the_capability(policy, te, needs):
    plan = plan_of(policy, "tiny-moe")
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan, te_version=te)
    assert needs in str(ei.value) and te in str(ei.value)
    mg.emit(plan, te_version="2.18.0")  # new enough


def test_declared_minimum_is_in_every_header():
    plan = plan_of("mxfp8-dequant-backward", "tiny-moe")
    arts = {a.path: a.content for a in mg.emit(plan)}
    for p in ("megatron/env.sh", "megatron/te_precision.yaml"):
        assert plan.content_hash() in arts[p] and "transformer-engine>=2.18.0" in arts[p], p
    flags = arts["megatron/flags.json"]
    assert plan.content_hash() in flags and '"transformer-engine": "2.18.0"' in flags
    e2e = {a.path: a.content for a in mg.emit(plan_of("mxfp8-e2e", "tiny-moe"))}
    assert "transformer-engine>=2.13.0" in e2e["megatron/env.sh"]


@pytest.mark.parametrize("body,tensor_re,capability_re", [
    ("""
     policy "x" { target blackwell; default bf16; attn.q: mxfp8 backward=quantized }
     """, r"self_attn\.[qkv]_proj", r"runs one TE recipe"),
    ("""
     policy "x" { target blackwell; default bf16; lm_head: mxfp8 backward=quantized }
     """, r"^lm_head", r"not a TransformerEngine module"),
    ("""
     policy "x" { target blackwell; default bf16; attn: mxfp8 backward=quantized
                  routed_experts: mxfp8 backward=high_precision }
     """, r".", r"backward mode"),
    ("""
     policy "x" { target blackwell; default bf16
                  routed_experts: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=high_precision }
     """, r"experts\.0\.(gate|up)_proj", r"one amax over the fused weight"),
])
def test_unsupported_plans_name_tensor_and_capability(tmp_path, body, tensor_re, capability_re):
    plan = resolve(_write_policy(tmp_path, body), arch_of("tiny-moe"), None)
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan)
    assert ei.value.backend == "megatron"
    assert re.search(tensor_re, ei.value.tensor), ei.value.tensor
    assert re.search(capability_re, ei.value.capability), ei.value.capability


def test_nvfp4_weights_refused_under_expert_tp():
    plan = plan_of("nvfp4-pertoken-hp-backward", "tiny-moe", "trainer:etp=2,ep=2")
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(plan)
    assert "experts" in ei.value.tensor and "TP=2" in ei.value.capability


def test_resolver_without_megatron_agrees_with_megatron_loader():
    plan = plan_of("mxfp8-e2e", "qwen3-30b-a3b")
    cfg = mg.trainer_config(plan)
    mods = list(cfg.module_recipes)
    a = mg.resolve_modules(cfg.flags, cfg.yamls, mods, plan.num_layers, 1, use_megatron=True)
    b = mg.resolve_modules(cfg.flags, cfg.yamls, mods, plan.num_layers, 1, use_megatron=False)
    assert a == b


@pytest.mark.parametrize("policy,model,parallel", [("nvfp4-pertoken-hp-backward", "deepseek-v3", "trainer:pp=4"),
                                                   ("mxfp8-e2e", "qwen3-30b-a3b", None)])
def test_args_txt_is_pasted_whole(policy, model, parallel, tmp_path):
    """`pretrain_gpt.py $(cat megatron/args.txt)`: every word the shell hands the script is a Megatron-LM flag or
    its value (no `# policyc ...` comment line: the hash is in flags.json / env.sh / the YAML), and megatron-core
    builds its TransformerConfig from exactly those words."""
    import megatron_oracle as mo

    plan = plan_of(policy, model, parallel)
    arts = mg.emit(plan)
    for a in arts:
        (tmp_path / a.path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / a.path).write_text(a.content)
    words = cat_words(tmp_path / "megatron/args.txt")
    assert words == mg.trainer_config(plan).flags
    config = mo.build_config(arch_of(model), words, tmp_path / "megatron")  # parse_flags: an unknown word fails
    assert config.num_layers == arch_of(model).num_layers
    from precision_dsl.backends.common import check_artifacts

    assert "megatron/flags.json" in check_artifacts(tmp_path, plan)
