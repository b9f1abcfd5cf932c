"""The vLLM oracle (tests/oracles/vllm_oracle.py) reproduces what vLLM's own code does with a checkpoint config.

Each test writes a tiny model directory (a bundled config.json under precision_dsl/models/, with a hand-made
`quantization_config`), builds it with vLLM 0.33.0 and checks a fact of vLLM's quantization dispatch:
  * ModelOpt MXFP8 (`quant_method: mxfp8`) reads `ignored_layers` only: `modules_to_not_convert` leaves every
    module quantized (vllm/model_executor/layers/quantization/modelopt.py: ModelOptMxFp8Config.from_config);
  * Qwen3-MoE builds its router `mlp.gate` as a GateLinear WITH the quant config, so a ModelOpt checkpoint
    quantizes it unless excluded (vllm/model_executor/models/qwen3_moe.py); DeepSeek-V3 / GLM-4.5 build it without;
  * ModelOpt exclusion matches by substring: excluding `model.layers.0.mlp.gate` also excludes the dense
    `model.layers.0.mlp.gate_up_proj` (modelopt.py: ModelOptQuantConfigBase.is_layer_excluded);
  * online `--quantization nvfp4_per_token` quantizes the routed experts only, per-token activations
    (vllm/config/quantization.py: _ONLINE_SHORTHANDS, quantization/online/nvfp4.py);
  * the released DeepSeek-V3 FP8-block config: 128x128 weights, 1x128 dynamic activations, routers in BF16;
  * the engine's own argument checks refuse what vLLM refuses (`--quantization nvfp4` is not a method name).
vLLM is never skipped: where it cannot be downloaded or loaded the tests fail with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oracles.vllm_oracle import VLLM_VERSIONS, OracleUnavailable, VllmRefused, parse_engine_args, \
    vllm_modules

REPO = Path(__file__).resolve().parents[1]
V = "0.33.0"


def model_dir(tmp_path, model: str, quantization_config=None, layers=None, **overrides) -> Path:
    """A config-only checkpoint directory: the bundled config.json of `model`, its quantization_config replaced
    (None: removed unless `keep`), the layer count reduced to `layers` to keep the meta build fast."""
    config = json.loads((REPO / "precision_dsl" / "models" / model / "config.json").read_text())
    if quantization_config != "keep":
        config.pop("quantization_config", None)
        if quantization_config is not None:
            config["quantization_config"] = quantization_config
    if layers is not None:
        config["num_hidden_layers"] = layers
    config.update(overrides)
    d = tmp_path / model
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def _quantized(mq) -> bool:
    return mq.weight != "bf16"


def test_versions_named():
    assert VLLM_VERSIONS[0] == V and "0.24.0" in VLLM_VERSIONS


def test_bf16_checkpoint_every_module_unquantized(vllm_033, tmp_path):
    mods = vllm_modules(V, model_dir(tmp_path, "tiny-moe"), [])
    n_layers = 4
    assert {m.layer for m in mods.values()} == {"VocabParallelEmbedding", "QKVParallelLinear", "RowParallelLinear",
                                                "GateLinear", "RoutedExperts", "ParallelLMHead"}
    assert all(m.weight == "bf16" and m.activation == "bf16" and m.method.startswith("Unquantized")
               for m in mods.values())
    qkv = mods["model.layers.0.self_attn.qkv_proj"]
    assert qkv.shards == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    experts = mods["model.layers.0.mlp.experts"]
    assert len(experts.shards) == 8 * 3 and "model.layers.0.mlp.experts.7.down_proj" in experts.shards
    assert sum(m.layer == "RoutedExperts" for m in mods.values()) == n_layers


def test_modelopt_mxfp8_reads_ignored_layers_not_modules_to_not_convert(vllm_033, tmp_path):
    skip = ["lm_head", "model.layers.0.self_attn.o_proj"]
    ignored = vllm_modules(V, model_dir(tmp_path / "a", "tiny-moe", {"quant_method": "mxfp8",
                                                                     "ignored_layers": skip}), [])
    not_converted = vllm_modules(V, model_dir(tmp_path / "b", "tiny-moe", {"quant_method": "mxfp8",
                                                                           "modules_to_not_convert": skip}), [])
    assert ignored["lm_head"].weight == "bf16"
    assert ignored["model.layers.0.self_attn.o_proj"].method == "UnquantizedLinearMethod"
    assert ignored["model.layers.1.self_attn.o_proj"].weight == "mxfp8/e4m3[1x32]"
    # the same list under modules_to_not_convert is not read: lm_head and o_proj run MXFP8
    for prefix in skip:
        assert not_converted[prefix].method == "ModelOptLinearMethod", prefix
        assert not_converted[prefix].weight == "mxfp8/e4m3[1x32]"
        assert not_converted[prefix].activation == "mxfp8 dynamic"
    experts = not_converted["model.layers.0.mlp.experts"]
    assert experts.method == "ModelOptMxFp8FusedMoE" and experts.weight == "mxfp8/e4m3[1x32]"


def test_qwen3_moe_router_is_quantized_unless_excluded(vllm_033, tmp_path):
    q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": None,
         "ignore": ["lm_head", "model.layers.0.mlp.gate"]}
    mods = vllm_modules(V, model_dir(tmp_path, "qwen3-30b-a3b", q, layers=2), [])
    gate0, gate1 = mods["model.layers.0.mlp.gate"], mods["model.layers.1.mlp.gate"]
    assert gate0.layer == gate1.layer == "GateLinear"
    assert gate0.method == "UnquantizedLinearMethod" and gate0.weight == "bf16"
    assert gate1.method == "ModelOptLinearMethod" and gate1.weight == "nvfp4[1x16,per_tensor]"
    assert gate1.activation == "nvfp4 static per-tensor"
    qkv = mods["model.layers.1.self_attn.qkv_proj"]
    assert qkv.weight == "nvfp4[1x16,shared]"  # vLLM takes the max of the q/k/v global scales
    experts = mods["model.layers.1.mlp.experts"]
    assert experts.method == "ModelOptNvFp4FusedMoE" and experts.activation == "nvfp4 static per-expert"
    assert experts.formats["model.layers.1.mlp.experts.0.gate_proj"] == "nvfp4[1x16,shared]"
    assert experts.formats["model.layers.1.mlp.experts.0.down_proj"] == "nvfp4[1x16,per_tensor]"
    assert experts.kernel_error  # no NVFP4 MoE kernel on a CPU: the decision is vLLM's, the kernel missing
    assert len(experts.shards) == 128 * 3


@pytest.mark.parametrize("model", ["deepseek-v3", "glm-4.5-air"])
def test_router_built_without_quant_config(vllm_033, tmp_path, model):
    q = {"quant_method": "modelopt", "quant_algo": "MXFP8", "kv_cache_scheme": None, "ignore": ["lm_head"]}
    mods = vllm_modules(V, model_dir(tmp_path, model, q, layers=2, first_k_dense_replace=1), [])
    gate = mods.get("model.layers.1.mlp.gate")
    assert gate is not None and gate.layer == "GateLinear"
    assert gate.method == "UnquantizedLinearMethod" and gate.weight == "bf16"
    assert mods["model.layers.1.mlp.experts"].weight == "mxfp8/e4m3[1x32]"
    shared = mods["model.layers.1.mlp.shared_experts.gate_up_proj"]
    assert shared.weight == "mxfp8/e4m3[1x32]" and shared.shards[-1].endswith("shared_experts.up_proj")


def test_modelopt_substring_exclusion_takes_gate_up_proj(vllm_033, tmp_path):
    """GLM-4.5-Air's layer 0 is dense: its `mlp.gate_up_proj` contains the excluded `model.layers.0.mlp.gate`."""
    q = {"quant_method": "modelopt", "quant_algo": "MXFP8", "kv_cache_scheme": None,
         "ignore": ["lm_head", "model.layers.0.mlp.gate"]}
    mods = vllm_modules(V, model_dir(tmp_path, "glm-4.5-air", q, layers=2), [])
    dense = mods["model.layers.0.mlp.gate_up_proj"]
    assert dense.layer == "MergedColumnParallelLinear"
    assert dense.shards == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert dense.method == "UnquantizedLinearMethod" and dense.weight == "bf16"
    assert mods["model.layers.0.mlp.down_proj"].weight == "mxfp8/e4m3[1x32]"
    assert mods["model.layers.1.mlp.shared_experts.gate_up_proj"].weight == "mxfp8/e4m3[1x32]"


def test_online_nvfp4_per_token_covers_moe_only(vllm_033, tmp_path):
    mods = vllm_modules(V, model_dir(tmp_path, "tiny-moe"), ["--quantization", "nvfp4_per_token"])
    experts = [m for m in mods.values() if m.layer == "RoutedExperts"]
    assert len(experts) == 4
    for m in experts:
        assert m.method == "Nvfp4OnlineMoEMethod"
        assert m.activation == "nvfp4 per-token"
        gate, up, down = (f"{m.shards[0].rsplit('.', 2)[0]}.0.{p}_proj" for p in ("gate", "up", "down"))
        assert m.formats[gate] == m.formats[up] == "nvfp4[1x16,shared]"  # one global scale over the whole w13
        assert m.formats[down] == "nvfp4[1x16,per_tensor]"
    others = [m for m in mods.values() if m.layer != "RoutedExperts"]
    assert others and all(m.weight == "bf16" and m.activation == "bf16" for m in others)


def test_online_linear_quantizes_the_qwen3_router(vllm_033, tmp_path):
    mods = vllm_modules(V, model_dir(tmp_path, "tiny-moe"), ["--quantization", "fp8_per_block"])
    assert mods["model.layers.0.mlp.gate"].weight.startswith("fp8_block/e4m3[128x128")
    assert mods["lm_head"].weight == "bf16"  # lm_head is never online-quantized
    ignored = vllm_modules(V, model_dir(tmp_path / "b", "tiny-moe"),
                           ["--quantization", "online", "--quantization-config",
                            json.dumps({"linear": "fp8_per_block", "moe": "fp8_per_block",
                                        "ignore": ["re:.*mlp\\.gate$"]})])
    assert ignored["model.layers.0.mlp.gate"].weight == "bf16"
    assert ignored["model.layers.0.self_attn.qkv_proj"].activation == "fp8 1x128 dynamic"


def test_deepseek_v3_release_fp8_block(vllm_033, tmp_path):
    mods = vllm_modules(V, model_dir(tmp_path, "deepseek-v3", "keep", layers=4), [])
    assert {m.method for m in mods.values() if m.layer != "VocabParallelEmbedding"} >= {"Fp8LinearMethod",
                                                                                         "Fp8MoEMethod"}
    for prefix in ("model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.self_attn.kv_b_proj",
                   "model.layers.0.mlp.gate_up_proj", "model.layers.3.mlp.experts",
                   "model.layers.3.mlp.shared_experts.down_proj"):
        assert mods[prefix].weight == "fp8_block/e4m3[128x128,fp32]", prefix
        assert mods[prefix].activation == "fp8 1x128 dynamic", prefix
    assert mods["model.layers.0.self_attn.fused_qkv_a_proj"].shards == [
        "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert mods["model.layers.3.mlp.gate"].weight == "bf16"
    assert mods["lm_head"].weight == "bf16"


def test_engine_args_refusals_are_vllms_own(vllm_033, tmp_path):
    d = model_dir(tmp_path, "tiny-moe")
    cfg = parse_engine_args(V, ["--model", str(d), "--skip-tokenizer-init", "--tensor-parallel-size", "2",
                                "--enable-expert-parallel"])
    assert cfg.parallel_config.tensor_parallel_size == 2 and cfg.parallel_config.enable_expert_parallel
    with pytest.raises(VllmRefused, match="nvfp4"):
        parse_engine_args(V, ["--model", str(d), "--skip-tokenizer-init", "--quantization", "nvfp4"])
    with pytest.raises(VllmRefused):  # an unknown key of the online schema
        parse_engine_args(V, ["--model", str(d), "--skip-tokenizer-init", "--quantization", "online",
                              "--quantization-config", '{"linear": "fp8_per_block", "typo": 1}'])


def test_online_nvfp4_per_token_needs_blackwell(vllm_033, tmp_path):
    """On Hopper vLLM still picks the online NVFP4 MoE method, whose constructor refuses anything but SM100."""
    mods = vllm_modules(V, model_dir(tmp_path, "tiny-moe"), ["--quantization", "nvfp4_per_token"], target="hopper")
    experts = mods["model.layers.0.mlp.experts"]
    assert experts.method == "Nvfp4OnlineMoEMethod" and "SM100" in experts.kernel_error


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_both_versions_exclude_by_substring_and_quantize_the_qwen3_router(version, tmp_path):
    """verl 0.9.1's vLLM (0.24.0) and 0.33.0 agree on these; 0.24.0 runs in a worker process when 0.33.0 is
    loaded here (one vLLM per process)."""
    q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": None,
         "ignore": ["lm_head", "model.layers.0.mlp.gate"]}
    try:
        mods = vllm_modules(version, model_dir(tmp_path / "q", "tiny-moe", q), [])
    except OracleUnavailable as err:
        pytest.fail(f"vLLM {version} oracle unavailable: {err}", pytrace=False)
    assert mods["model.layers.0.mlp.gate"].weight == "bf16"
    assert mods["model.layers.1.mlp.gate"].weight == "nvfp4[1x16,per_tensor]"
    assert mods["model.layers.1.self_attn.qkv_proj"].weight == "nvfp4[1x16,shared]"
    assert mods["model.layers.1.mlp.experts"].method == "ModelOptNvFp4FusedMoE"
    assert mods["lm_head"].weight == "bf16"
    # a ModelOpt checkpoint's method wins over --quantization, even one that names no method
    assert parse_engine_args(version, ["--model", str(tmp_path / "q" / "tiny-moe"), "--skip-tokenizer-init",
                                       "--quantization", "nvfp4"]).model_config.quantization == "modelopt_fp4"
    with pytest.raises(VllmRefused, match="nvfp4"):
        parse_engine_args(version, ["--model", str(model_dir(tmp_path / "b", "tiny-moe")), "--skip-tokenizer-init",
                                    "--quantization", "nvfp4"])
    q = {"quant_method": "modelopt", "quant_algo": "MXFP8", "kv_cache_scheme": None,
         "ignore": ["lm_head", "model.layers.0.mlp.gate"]}
    glm_dir = model_dir(tmp_path / "g", "glm-4.5-air", q, layers=2)
    if version == "0.24.0":  # its ModelConfig._verify_quantization misses modelopt_mxfp8 in its override order
        with pytest.raises(VllmRefused, match="mxfp8 is an override"):
            vllm_modules(version, glm_dir, [])
        return
    glm = vllm_modules(version, glm_dir, [])
    assert glm["model.layers.0.mlp.gate_up_proj"].weight == "bf16"
    assert glm["model.layers.0.mlp.down_proj"].weight == "mxfp8/e4m3[1x32]"
