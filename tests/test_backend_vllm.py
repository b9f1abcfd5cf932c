"""backends/vllm.py: vLLM 0.33 engine args / env / the checkpoint quantization_config.

For every shipped policy x {tiny-moe, qwen3-30b-a3b, deepseek-v3, glm-4.5-air}: either the emitted configuration,
read back with vLLM's matching rules (`derive_formats`), serves exactly the plan's weight format for every module
vLLM loads, or the refusal names the reason expected for that cell. vLLM's own code judges the same artifacts in
tests/test_vllm_judge.py."""

from __future__ import annotations

import functools
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.backends import vllm
from precision_dsl.backends.common import Problems, UnsupportedByBackend
from precision_dsl.parallel import parse_parallel
from precision_dsl.resolve import resolve

from conftest import DENSE_RECIPES

REPO = Path(__file__).resolve().parents[1]
POLICIES = sorted(p.stem for p in (REPO / "policies").glob("*.policy") if p.stem not in DENSE_RECIPES)
MODELS = ["tiny-moe", "qwen3-30b-a3b", "deepseek-v3", "glm-4.5-air"]

# The cells vLLM 0.33.0 cannot serve exactly, and the words their refusal must carry.
REFUSED = {
    "language-tour": "'pow2' FP8-block scales",
    "nvfp4-weight-only": "weight-only NVFP4",
    # a shard boundary inside a 128-row block of the fused weight: tiny-moe k_proj N = 64 in qkv_proj, GLM-4.5-Air
    # dense gate_proj N = 10944 in gate_up_proj
    ("fp8-blockwise-hopper", "tiny-moe"): "scale grid then straddles two shards",
    ("fp8-blockwise-hopper", "glm-4.5-air"): "scale grid then straddles two shards",
}


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=4)
def plan_of(policy, model, parallel=None):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), parse_parallel(parallel))


def plan_text(tmp_path, text, model="tiny-moe", parallel=None):
    p = tmp_path / "p.policy"
    p.write_text(textwrap.dedent(text))
    return resolve(p, arch_of(model), parse_parallel(parallel))


def emit(plan, options=None):
    problems = Problems()
    arts = vllm.VllmBackend().emit(plan, options, problems)
    return {a.path: a.data() for a in arts}, problems.folded()


def plan_weights(plan, names) -> dict[str, str]:
    by = plan.by_name()
    return {n: by[n].weight.short() if by[n].is_linear and by[n].weight.is_quantized else "bf16" for n in names}


def served_names(plan) -> set[str]:
    """Every tensor vLLM loads into a GEMM module: linears and routers outside MTP."""
    return {t.hf_name for t in plan.tensors if t.mtp is None and (t.is_linear or t.role == "router.weight")}


def manifest(arts):
    return json.loads(arts[vllm.MANIFEST])


def arg(args, name):
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", POLICIES)
def test_shipped_policy_is_served_exactly_or_refused_by_name(policy, model):
    plan = plan_of(policy, model)
    arts, problems = emit(plan)
    reason = REFUSED.get((policy, model), REFUSED.get(policy))
    if reason is not None:
        assert not arts
        assert problems and any(reason in p.capability for p in problems), [str(p) for p in problems]
        assert all(p.backend == "vllm" and p.hint for p in problems)
        return
    assert not problems, [str(p) for p in problems]
    derived = vllm.VllmBackend().derive_formats(arts, arch_of(model))
    assert set(derived) == served_names(plan)
    assert derived == plan_weights(plan, derived)
    m = manifest(arts)
    assert m["policyc"]["content_hash"] == plan.content_hash()
    # what both judged releases serve the same way declares their range (tests/test_vllm_judge.py judges it)
    both = policy in ("bf16", "keep-bf16", "fp8-blockwise-hopper") and model != "deepseek-v3"
    assert m["requires"] == ("vllm>=0.24.0,<=0.33.0" if both else "vllm==0.33.0")
    assert m["requires"] in arts["vllm/env.sh"].decode().splitlines()[0]
    assert not arts["vllm/launch_args.txt"].decode().startswith("#")
    args = m["engine_args"]
    assert arg(args, "--kv-cache-dtype") == "bfloat16"  # never `auto` (it follows the checkpoint's kv algo)
    qcfg = m["quantization_config"]
    if qcfg is None:
        assert "--quantization" not in args and "--hf-overrides" not in args
        return
    assert json.loads(arg(args, "--hf-overrides")) == {"quantization_config": qcfg}
    assert json.loads(arts["vllm/quantization_config.json"])["quantization_config"] == qcfg
    env = arts["vllm/env.sh"].decode()
    if policy.startswith("nvfp4") or policy == "miles-nvfp4":
        assert arg(args, "--quantization") == "modelopt_fp4"
        assert json.loads(arg(args, "--quantization-config")) == {"moe": {"activation": "nvfp4_per_token"}}
        assert arg(args, "--moe-backend") == "flashinfer_trtllm"
        assert "lm_head" in qcfg["ignore"]  # ModelOpt quantizes ParallelLMHead unless excluded
        assert qcfg["config_groups"]["group_0"]["input_activations"] is not None  # else vLLM downgrades to W4A16
        assert "export FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1" in env
        assert "export TRTLLM_DISABLE_FP4_QUANT_FAST_MATH=1" in env
    if policy.startswith("mxfp8"):
        assert arg(args, "--quantization") == "modelopt_mxfp8"
        assert qcfg["quant_method"] == "modelopt" and qcfg["quant_algo"] == "MXFP8" and "lm_head" in qcfg["ignore"]
        assert arg(args, "--linear-backend") == "flashinfer_cutlass" and arg(args, "--moe-backend") == "flashinfer_trtllm"
    if policy.startswith("fp8"):
        assert arg(args, "--quantization") == "fp8" and qcfg["weight_block_size"] == [128, 128]
        assert arg(args, "--linear-backend") == "triton"
        assert "export VLLM_USE_DEEP_GEMM=0" in env and "export VLLM_USE_DEEP_GEMM_E8M0=0" in env
    if model == "qwen3-30b-a3b":  # the router is a GateLinear built WITH the quant config: excluded by name
        excl = qcfg.get("ignore") or qcfg.get("ignored_layers")
        assert "model.layers.0.mlp.gate" in excl


def test_router_left_out_of_the_config_would_be_quantized():
    plan = plan_of("fp8-blockwise-hopper", "qwen3-30b-a3b")
    arts, problems = emit(plan)
    assert not problems
    m = manifest(arts)
    qcfg = dict(m["quantization_config"])
    qcfg["ignored_layers"] = [e for e in qcfg["ignored_layers"] if not e.endswith(".mlp.gate")]
    args = list(m["engine_args"])
    args[args.index("--hf-overrides") + 1] = json.dumps({"quantization_config": qcfg})
    arts = {vllm.MANIFEST: json.dumps({**m, "engine_args": args}).encode()}
    derived = vllm.VllmBackend().derive_formats(arts, arch_of("qwen3-30b-a3b"))
    assert derived["model.layers.0.mlp.gate.weight"] == "fp8_block/e4m3[128x128,fp32]"
    # ... and with DeepGEMM's default env the block scales become UE8M0 (power-of-two)
    arts = {vllm.MANIFEST: json.dumps({**m, "env": {}}).encode()}
    derived = vllm.VllmBackend().derive_formats(arts, arch_of("qwen3-30b-a3b"))
    assert derived["model.layers.0.self_attn.q_proj.weight"] == "fp8_block/e4m3[128x128,pow2]"


def test_modelopt_substring_rule_and_the_bracketed_exclusion():
    fused = {"gate_up_proj": ["gate_proj", "up_proj"]}
    assert vllm.is_layer_excluded("model.layers.1.mlp.gate_up_proj", ["model.layers.1.mlp.gate"], fused)
    assert not vllm.is_layer_excluded("model.layers.1.mlp.gate_up_proj", ["model.layers.1.mlp.gat[e]"], fused)
    assert vllm.is_layer_excluded("model.layers.1.mlp.gate", ["model.layers.1.mlp.gat[e]"], fused)
    # Fp8Config's exact mode: one expert listed skips the layer's RoutedExperts; shards must agree
    assert vllm.is_layer_skipped("model.layers.2.mlp.experts", ["model.layers.2.mlp.experts.7.down_proj"], {})
    assert not vllm.is_layer_skipped("model.layers.1.mlp.gate_up_proj", ["model.layers.1.mlp.gate"], fused)
    with pytest.raises(ValueError, match="some but not all shards"):
        vllm.is_layer_skipped("model.layers.1.mlp.gate_up_proj", ["model.layers.1.mlp.gate_proj"], fused)
    # online / compressed-tensors `re:` is re.match: anchored at the start only
    assert vllm.should_ignore_layer("model.layers.1.mlp.gate_up_proj", [r"re:.*mlp\.gate"], fused)
    assert not vllm.should_ignore_layer("model.layers.1.mlp.gate_up_proj", [r"re:.*mlp\.gate$"], fused)


def test_modelopt_exclusion_that_would_hit_a_quantized_sibling_is_bracketed(tmp_path):
    plan = plan_of("miles-nvfp4", "qwen3-30b-a3b")
    plan = plan.model_copy(update={"tensors": tuple(plan.tensors)})
    # a hand-made exclusion list: the router's name inside a quantized module's prefix
    out = vllm._exclusions(plan, {"model.layers.0.mlp.gate_up_proj"}, modelopt=True)
    assert "model.layers.0.mlp.gat[e]" in out and "model.layers.0.mlp.gate" not in out
    assert "model.layers.1.mlp.gate" in out


@pytest.mark.parametrize("parallel,want,refusal", [
    ("rollout:tp=4,ep=4", ["--tensor-parallel-size", "4", "--enable-expert-parallel"], None),
    ("rollout:tp=2,ep=4,etp=1", ["--tensor-parallel-size", "2", "--data-parallel-size", "2",
                                 "--enable-expert-parallel"], None),
    ("rollout:tp=2,etp=2", ["--tensor-parallel-size", "2"], None),
    ("rollout:tp=2,etp=2,pp=2", ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], None),
    ("rollout:tp=4,ep=2", None, "ep must be a multiple of tp"),
    ("rollout:tp=2,etp=1", None, "TP-splits the routed experts over all tp ranks"),
])
def test_layout_engine_args(parallel, want, refusal):
    plan = plan_of("bf16", "tiny-moe", parallel)
    arts, problems = emit(plan)
    if refusal is not None:
        assert not arts and any(refusal in p.capability for p in problems), [str(p) for p in problems]
        return
    assert not problems, [str(p) for p in problems]
    args = manifest(arts)["engine_args"]
    assert args[:len(want)] == want
    assert ("--enable-expert-parallel" in args) == ("ep=" in parallel)


def test_engine_version_is_checked():
    plan = plan_of("bf16", "tiny-moe")
    arts, problems = emit(plan, SimpleNamespace(vllm_version="0.23.1"))
    assert not arts and "older than 0.24.0" in problems[0].capability
    arts, problems = emit(plan, SimpleNamespace(vllm_version="x.y"))
    assert not arts and "cannot read the vLLM version" in problems[0].capability
    for version in ("0.24.0", "0.30.0", "0.33.1"):
        arts, problems = emit(plan, SimpleNamespace(vllm_version=version))
        assert arts and not problems
        assert manifest(arts)["requires"] == "vllm>=0.24.0,<=0.33.0"
    mx = plan_of("mxfp8-e2e", "qwen3-30b-a3b")
    arts, problems = emit(mx, SimpleNamespace(vllm_version="0.24.0"))
    assert not arts and any("MXFP8 on vLLM 0.24.0" in p.capability for p in problems)
    arts, problems = emit(mx, SimpleNamespace(vllm_version="0.33.0"))
    assert manifest(arts)["requires"] == "vllm==0.33.0"


def test_derive_formats_of_a_missing_or_bad_manifest_is_an_artifact_error():
    from precision_dsl.backends.common import ArtifactError

    with pytest.raises(ArtifactError, match="missing"):
        vllm.VllmBackend().derive_formats({}, arch_of("tiny-moe"))
    with pytest.raises(ArtifactError, match="engine args"):
        vllm.VllmBackend().derive_formats({vllm.MANIFEST: b'{"env": {}}'}, arch_of("tiny-moe"))


def test_hopper_target_with_quantized_mx_activations_is_refused(tmp_path):
    plan = plan_text(tmp_path, """
        policy "t" {
            target hopper emulate
            default bf16
            routed_experts: mxfp8
        }
        """)
    arts, problems = emit(plan)
    assert not arts and any("Marlin" in p.capability and "SM100" in p.capability for p in problems)


@pytest.mark.parametrize("text,reason", [
    ("attn.q: fp8_block(scales=fp32)", "into qkv_proj, one quant method for all shards"),
    ("routed_experts: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=dequantized",
     "w13_weight_scale_2[:, 0]"),
    ("attn: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=dequantized\n share_scale attn.{q, k, v}",
     "NVFP4 outside routed experts"),
    ("routed_experts: nvfp4(weight_scale=per_tensor) backward=dequantized\n share_scale routed_experts.{gate, up}",
     "static global input scale"),
    ('layers[0].routed_experts: fp8_block(scales=fp32)\n name("model.layers.0.mlp.experts.1.*"): bf16',
     "runs all routed experts of a layer with one quant method"),
])
def test_what_vllm_cannot_express_is_refused_by_name(tmp_path, text, reason):
    plan = plan_text(tmp_path, f"""
        policy "t" {{
            target blackwell
            default bf16
            {text}
        }}
        """)
    arts, problems = emit(plan)
    assert not arts
    assert any(reason in p.capability for p in problems), [str(p) for p in problems]
    with pytest.raises(UnsupportedByBackend):
        vllm.emit(plan)


def test_every_refusal_is_collected(tmp_path):
    plan = plan_text(tmp_path, """
        policy "t" {
            target blackwell
            default bf16
            attn: mxfp8
            routed_experts: weight=nvfp4(weight_scale=per_tensor), act=bf16
            share_scale routed_experts.{gate, up}
        }
        """, parallel="rollout:tp=4,ep=2")
    _, problems = emit(plan)
    text = " | ".join(p.capability for p in problems)
    for reason in ("weight-only NVFP4", "ep must be a multiple of tp", "one checkpoint mixing"):
        assert reason in text


def test_mla_kv_b_proj_quantized_is_refused(tmp_path):
    plan = plan_text(tmp_path, """
        policy "t" {
            target hopper
            default bf16
            attn: fp8_block(scales=fp32)
        }
        """, model="deepseek-v3")
    _, problems = emit(plan)
    assert any("split_kv_b_proj" in p.capability and "kv_b_proj" in p.tensor for p in problems)
