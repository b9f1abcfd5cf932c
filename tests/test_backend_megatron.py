"""backends/megatron.py, validated by megatron-core 0.16.1 itself:

* the emitted flags build a TransformerConfig (MLATransformerConfig for DeepSeek-V3) without validation errors
  (flag -> field per ../shared/research/backends.md A.1; MoE+FP8 needs the A.5 is_te_min_version monkeypatch on a
  machine without TransformerEngine);
* every emitted YAML loads with `megatron.core.quantization.utils.load_quantization_recipe`, and EVERY Megatron
  module of the architecture, resolved per PP stage with `get_quant_config_or_none` +
  `TEQuantizationParams.parse_from_config`, runs the format the plan says;
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

from conftest import SEED_POLICIES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEEDS = SEED_POLICIES
FLAG_FIELDS = {  # Megatron-LM CLI flag -> TransformerConfig field (backends.md A.1)
    "--fp8-format": "fp8", "--fp8-recipe": "fp8_recipe", "--fp4-format": "fp4", "--fp4-recipe": "fp4_recipe",
    "--num-layers-at-start-in-bf16": "num_layers_at_start_in_bf16",
    "--num-layers-at-end-in-bf16": "num_layers_at_end_in_bf16",
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--expert-tensor-parallel-size": "expert_tensor_parallel_size",
}
BOOL_FLAGS = {"--bf16": "bf16", "--first-last-layers-bf16": "first_last_layers_bf16", "--fp8-param-gather": "fp8_param",
              "--fp4-param-gather": "fp4_param", "--moe-grouped-gemm": "moe_grouped_gemm"}
NOT_CONFIG_FIELDS = {"--transformer-impl", "--te-precision-config-file"}  # megatron.training args


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=None)
def plan_of(policy, model, parallel=None):
    path = Path(policy) if Path(policy).is_file() else REPO / "policies" / f"{policy}.policy"
    return resolve(path, arch_of(model), parse_parallel(parallel))


def config_kwargs(flags: list[str]) -> dict:
    kw, i = {}, 0
    while i < len(flags):
        f = flags[i]
        if f in BOOL_FLAGS:
            kw[BOOL_FLAGS[f]] = True
            i += 1
        elif f in FLAG_FIELDS:
            val = flags[i + 1]
            kw[FLAG_FIELDS[f]] = int(val) if val.isdigit() else val
            i += 2
        elif f in NOT_CONFIG_FIELDS:
            i += 2
        else:
            raise AssertionError(f"emitted flag {f} has no known TransformerConfig field")
    return kw


def build_transformer_config(arch, flags, monkeypatch):
    import megatron.core.transformer.transformer_config as tc

    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)  # A.5: MoE+FP8 check without TE
    c = arch.config
    kw = dict(num_layers=arch.num_layers, hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
              ffn_hidden_size=c.get("intermediate_size", 4 * c["hidden_size"]),
              num_moe_experts=c.get("num_experts") or c.get("n_routed_experts"),
              moe_ffn_hidden_size=c.get("moe_intermediate_size"), moe_router_topk=c.get("num_experts_per_tok", 2),
              add_bias_linear=False, gated_linear_unit=True)
    kw.update(config_kwargs(flags))
    if kw.get("pipeline_model_parallel_size", 1) > 1:
        import torch

        kw["pipeline_dtype"] = torch.bfloat16
    if c.get("model_type") == "deepseek_v3":
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kw, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                                    qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"],
                                    v_head_dim=c["v_head_dim"])
    return tc.TransformerConfig(**kw, num_query_groups=c.get("num_key_value_heads"),
                                kv_channels=c.get("head_dim"))


KIND_OF_RECIPE = {"mxfp8": "mxfp8", "blockwise": "fp8_block", "tensorwise": "fp8", "nvfp4": "nvfp4"}


@functools.lru_cache(maxsize=64)
def _load_recipe(path: str, mtime: int):
    from megatron.core.quantization.utils import load_quantization_recipe

    return load_quantization_recipe(path)


def megatron_resolve(flags, yaml_files: dict[str, Path], module: str, num_layers: int, pp: int) -> str:
    """What megatron-core runs for one global module path: global recipe, first/last BF16 (global indices),
    then the stage's YAML through megatron-core's own loader and matcher (stage-local indices)."""
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.utils import get_quant_config_or_none

    def flag(n):
        return flags[flags.index(n) + 1] if n in flags else None

    glob = KIND_OF_RECIPE.get(flag("--fp8-recipe") or flag("--fp4-recipe") or "", "bf16")
    if glob == "bf16":
        return "bf16"
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", module)
    lps = num_layers // pp
    if m and "--first-last-layers-bf16" in flags:
        layer = int(m.group(1))
        if layer < int(flag("--num-layers-at-start-in-bf16")) or \
                layer >= num_layers - int(flag("--num-layers-at-end-in-bf16")):
            return "bf16"
    stage = int(m.group(1)) // lps if m else pp - 1
    local = f"decoder.layers.{int(m.group(1)) - stage * lps}.{m.group(2)}" if m else module
    path = yaml_files.get(f"te_precision.stage{stage}.yaml") or yaml_files.get("te_precision.yaml")
    if path is None:
        return glob
    qc = get_quant_config_or_none(local, _load_recipe(str(path), path.stat().st_mtime_ns))
    if qc is None:
        return glob
    r = TEQuantizationParams.parse_from_config(qc).training_recipe
    name = r.fp8_quantization_recipe or r.fp4_quantization_recipe
    return KIND_OF_RECIPE[getattr(name, "value", name)] if name else "bf16"


def check_plan_against_megatron(plan, arch, tmp_path, monkeypatch, pp=1):
    arts = {a.path: a for a in mg.emit(plan)}
    flags = arts["megatron/args.txt"].content.split()
    build_transformer_config(arch, flags, monkeypatch)
    yaml_files = {}
    for p, a in arts.items():
        if p.endswith(".yaml"):
            f = tmp_path / Path(p).name
            f.write_text(a.content)
            yaml_files[f.name] = f
    expected: dict[str, str] = {}
    for t in plan.tensors:
        if t.is_linear and t.megatron_name and t.megatron_name.split(".")[0] in ("decoder", "mtp") \
                and t.role != "mtp.eh_proj":
            expected[mg.megatron_module(t.megatron_name)] = t.weight.kind.value if t.weight.is_quantized else "bf16"
    assert expected, "no TE modules found"
    got = {m: megatron_resolve(flags, yaml_files, m, arch.num_layers, pp) for m in expected}
    wrong = {m: (got[m], expected[m]) for m in expected if got[m] != expected[m]}
    assert not wrong, f"modules resolving to the wrong format (got, plan): {dict(list(wrong.items())[:5])}"
    return arts, flags


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", ["tiny-moe", "qwen3-30b-a3b"])
def test_seed_policies_validate_in_megatron_core(seed, model, tmp_path, monkeypatch):
    plan = plan_of(seed, model)
    arts, flags = check_plan_against_megatron(plan, arch_of(model), tmp_path, monkeypatch)
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
                    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1", "NVTE_NVFP4_ROW_SCALED_ACTIVATION=1",
                    "NVTE_USE_FAST_MATH=0"):
            assert f"export {var}" in env
    if seed.endswith("hp-backward"):
        assert "NVTE_BACKWARD_OVERRIDE=high_precision" in env
    if seed.endswith("dequant-backward"):
        assert "NVTE_BACKWARD_OVERRIDE=dequantized" in env
    if seed == "mxfp8-e2e":
        assert "NVTE_BACKWARD_OVERRIDE" not in env


@pytest.mark.parametrize("seed", ["mxfp8-e2e", "nvfp4-pertoken-dequant-backward"])
def test_deepseek_mla_config_and_every_module(seed, tmp_path, monkeypatch):
    plan = plan_of(seed, "deepseek-v3")
    arts, flags = check_plan_against_megatron(plan, arch_of("deepseek-v3"), tmp_path, monkeypatch)
    yaml_text = arts["megatron/te_precision.yaml"].content
    assert "linear_kv_up_proj" not in yaml_text  # kv_b stays bf16 through the catch-all, never matched as quantized


def test_first_last_counts_are_explicit_and_global(tmp_path, monkeypatch):
    # keep-bf16: layers[-15%:] of 48 layers -> the last 8 (40..47) BF16
    plan = plan_of("mxfp8-e2e", "qwen3-30b-a3b")
    _, flags = check_plan_against_megatron(plan, arch_of("qwen3-30b-a3b"), tmp_path, monkeypatch)
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


def test_layer_specific_plan_emits_one_yaml_per_pp_stage(tmp_path, monkeypatch):
    pol = _write_policy(tmp_path, LAYER_SPECIFIC)
    plan = resolve(pol, arch_of("tiny-moe"), parse_parallel("trainer:pp=2"))
    arts, flags = check_plan_against_megatron(plan, arch_of("tiny-moe"), tmp_path, monkeypatch, pp=2)
    assert {"megatron/te_precision.stage0.yaml", "megatron/te_precision.stage1.yaml"} <= set(arts)
    # stage-local indices: global layer 3 is decoder.layers.1 on stage 1
    assert "decoder.layers.1.mlp.experts.linear_fc1" in arts["megatron/te_precision.stage1.yaml"].content
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in arts["megatron/env.sh"].content


def test_layer_agnostic_plan_emits_single_yaml_under_pp(tmp_path, monkeypatch):
    plan = plan_of("mxfp8-hp-backward", "tiny-moe", "trainer:pp=2")
    arts, _ = check_plan_against_megatron(plan, arch_of("tiny-moe"), tmp_path, monkeypatch, pp=2)
    yamls = [p for p in arts if p.endswith(".yaml")]
    assert yamls == ["megatron/te_precision.yaml"]
    assert re.search(r"decoder\.layers\.\d", arts[yamls[0]].content) is None


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


def test_uneven_pipeline_split_only_matters_for_layer_specific_plans(tmp_path, monkeypatch):
    # layer-agnostic YAML: any pp works (first/last counts are global indices)
    plan = plan_of("mxfp8-hp-backward", "tiny-moe", "trainer:pp=3")
    arts = {a.path for a in mg.emit(plan)}
    assert "megatron/te_precision.yaml" in arts
    # layer-specific: stage-local indices need known stage boundaries
    pol = _write_policy(tmp_path, LAYER_SPECIFIC)
    with pytest.raises(UnsupportedByBackend) as ei:
        mg.emit(resolve(pol, arch_of("tiny-moe"), parse_parallel("trainer:pp=3")))
    assert "pp=3" in ei.value.capability and ei.value.tensor.startswith("decoder.layers.*.")
