"""backends/sglang.py: SGLang 0.5.23 server args / env / checkpoint quantization_config.

The exemption list is checked by re-deriving, with SGLang's own matching rules (fp8/mxfp8 `is_layer_skipped`,
ModelOpt `is_layer_excluded`), which tensors the server would quantize - it must be exactly the plan's set."""

from __future__ import annotations

import functools
import json
import re
import textwrap
from pathlib import Path

import pytest

from precision_dsl.backends import sglang
from precision_dsl.backends.common import UnsupportedByBackend
from precision_dsl.arch import load_architecture
from precision_dsl.parallel import parse_parallel
from precision_dsl.resolve import resolve

from conftest import SEED_POLICIES

REPO = Path(__file__).resolve().parents[1]
SEEDS = SEED_POLICIES
MXFP8_MOE_BACKENDS = {"cutlass", "deep_gemm", "flashinfer_megamoe", "flashinfer_trtllm", "flashinfer_trtllm_routed"}
METHOD_OF_CONFIG = {"mxfp8": "mxfp8", "fp8": "fp8", "modelopt": "modelopt_fp4"}


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=None)
def plan_of(policy, model, parallel=None):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), parse_parallel(parallel))


def plan_from_text(tmp_path, text, model="tiny-moe", parallel=None):
    p = tmp_path / "p.policy"
    p.write_text(textwrap.dedent(text))
    return resolve(p, arch_of(model), parse_parallel(parallel))


def plan_formats(plan):
    """The weight format (TensorFormat.short()) SGLang must run for each tensor: bf16 where it is not quantized."""
    return {t.hf_name: (t.weight.short() if t.is_linear and t.weight.is_quantized else "bf16")
            for t in plan.tensors}


def arg(args, name):
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", ["tiny-moe", "qwen3-30b-a3b"])
def test_exemptions_rederived_with_sglang_rules_match_plan(seed, model):
    plan = plan_of(seed, model)
    arts = {a.path: a for a in sglang.emit(plan)}
    manifest = json.loads(arts["sglang/server_args.json"].content)
    assert manifest["policyc"]["content_hash"] == plan.content_hash()
    qcfg = json.loads(arts["sglang/quantization_config.json"].content)["quantization_config"]
    assert sglang.derive_formats_of_config(qcfg, arch_of(model)) == plan_formats(plan)
    args = manifest["server_args"]
    assert arg(args, "--kv-cache-dtype") == "bf16"
    if qcfg is None:
        assert "--quantization" not in args
    else:
        assert arg(args, "--quantization") == METHOD_OF_CONFIG[qcfg["quant_method"]]
    if seed.startswith("mxfp8"):
        assert arg(args, "--moe-runner-backend") in MXFP8_MOE_BACKENDS
        assert qcfg["weight_block_size"] == [1, 32] and qcfg["scale_fmt"] == "ue8m0"
    if seed.startswith("nvfp4"):
        env = arts["sglang/env.sh"].content
        assert "export SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1" in env
        assert "export FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1" in env
        assert "export TRTLLM_DISABLE_FP4_QUANT_FAST_MATH=1" in env
        hq = json.loads(arts["sglang/hf_quant_config.json"].content)
        assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
        assert hq["quantization"]["kv_cache_quant_algo"] is None  # bf16 KV, never `auto` -> FP8


@pytest.mark.parametrize("seed", ["mxfp8-e2e", "nvfp4-pertoken-hp-backward"])
def test_deepseek_mla_fused_and_mtp_prefixes(seed):
    plan = plan_of(seed, "deepseek-v3")
    cfg = sglang.rollout_config(plan)
    assert sglang.derive_formats_of_config(cfg.quantization_config, arch_of("deepseek-v3")) == plan_formats(plan)
    if seed == "mxfp8-e2e":
        assert "model.layers.0.self_attn.kv_b_proj" in cfg.exclude  # keep-bf16: attn.kv_b
        assert "model.layers.3.mlp.shared_experts.gate_proj" in cfg.exclude


def test_rollout_parallel_layout_in_args():
    plan = plan_of("mxfp8-e2e", "qwen3-30b-a3b", "rollout:tp=8,ep=8")
    args = sglang.rollout_config(plan).server_args
    assert arg(args, "--tp-size") == "8" and arg(args, "--ep-size") == "8"
    assert arg(args, "--moe-runner-backend") == "flashinfer_trtllm"  # cutlass MXFP8 MoE has no EP


@pytest.mark.parametrize("text,model,tensor_re,capability_re", [
    # fused qkv: q quantized, k/v not
    ('policy "x" { target blackwell; default bf16; attn.q: mxfp8 backward=quantized }', "tiny-moe",
     r"self_attn\.[qkv]_proj", r"fuses .*q_proj.*one GEMM"),
    # one expert of a layer in another format than its siblings
    ('policy "x" { target blackwell; default bf16; routed_experts: mxfp8 backward=quantized\n'
     '  name("model.layers.1.mlp.experts.3.*"): bf16 }', "tiny-moe", r"layers\.1\.mlp\.experts",
     r"FusedMoE .*one\s+quant method"),
    # MXFP8 attention + NVFP4 experts in one checkpoint
    ('policy "x" { target blackwell; default bf16; attn: mxfp8 backward=quantized\n'
     '  routed_experts: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=high_precision\n'
     '  share_scale routed_experts.{gate, up} }', "tiny-moe", r".", r"mixing .*mxfp8.*nvfp4|nvfp4.*mxfp8"),
    # NVFP4 gate/up without a shared global scale
    ('policy "x" { target blackwell; default bf16\n'
     '  routed_experts: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=high_precision }', "tiny-moe",
     r"experts\.0\.gate_proj", r"weight_scale_2"),
    # NVFP4 on attention: per-token activations exist only in the MoE runner
    ('policy "x" { target blackwell; default bf16\n'
     '  attn.o: nvfp4(act_scale=per_token, weight_scale=per_tensor) backward=high_precision }', "tiny-moe",
     r"o_proj", r"outside routed experts"),
])
def test_unsupported_plans_name_tensor_and_capability(tmp_path, text, model, tensor_re, capability_re):
    plan = plan_from_text(tmp_path, text, model)
    with pytest.raises(UnsupportedByBackend) as ei:
        sglang.emit(plan)
    assert ei.value.backend == "sglang"
    assert re.search(tensor_re, ei.value.tensor), ei.value.tensor
    assert re.search(capability_re, ei.value.capability, re.S), ei.value.capability


def test_fused_q_a_kv_a_must_agree_on_deepseek(tmp_path):
    plan = plan_from_text(tmp_path, 'policy "x" { target blackwell; default bf16; attn.q_a: mxfp8 backward=quantized }',
                          "deepseek-v3")
    with pytest.raises(UnsupportedByBackend) as ei:
        sglang.rollout_config(plan)
    assert "fused_qkv_a_proj_with_mqa" in ei.value.capability


def test_block_fp8_moe_tp_divisibility(tmp_path):
    text = 'policy "x" { target hopper; default bf16; routed_experts: fp8_block(scales=fp32) backward=quantized }'
    plan = plan_from_text(tmp_path, text, "qwen3-30b-a3b", "rollout:tp=8,ep=1")  # 768 / 8 = 96, not % 128
    with pytest.raises(UnsupportedByBackend) as ei:
        sglang.rollout_config(plan)
    assert "moe_tp" in ei.value.capability and "experts" in ei.value.tensor
    ok = plan_from_text(tmp_path, text, "qwen3-30b-a3b", "rollout:tp=8,ep=8")
    cfg = sglang.rollout_config(ok)
    assert cfg.quantization_config["weight_block_size"] == [128, 128] and cfg.method == "fp8"
    assert sglang.derive_formats_of_config(cfg.quantization_config, arch_of("qwen3-30b-a3b")) == plan_formats(ok)


def test_partially_exempt_fused_module_is_rejected_like_sglang():
    cfg = {"quant_method": "mxfp8", "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}
    with pytest.raises(ValueError, match="same precision"):
        sglang.derive_formats_of_config(cfg, arch_of("tiny-moe"))
