"""Architecture catalog: names, shapes, roles, counts, Megatron / SGLang names, error handling, speed.

Expected counts are derived from the configs with the per-layer structure spelled out here (independently of the
adapters' code), and cross-checked against public totals (model cards): Qwen3-30B-A3B 30.5B, DeepSeek-V3 671B main
model + MTP, Llama-3.2-1B 1.24B, Qwen3-0.6B 0.6B. Transformers' own naming is checked in test_arch_oracle.py.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest

from precision_dsl.arch import (
    FUSED_SIBLINGS,
    LINEAR_ROLES,
    ROLES,
    ArchitectureError,
    TensorInfo,
    architecture_from_config,
    fused_groups,
    list_bundled,
    load_architecture,
    megatron_params,
    sglang_modules,
    supported_model_types,
)
from precision_dsl.arch import _emit

BUNDLED = ["deepseek-v3", "glm-4.5-air", "llama-3.2-1b", "qwen3-0.6b", "qwen3-30b-a3b", "qwen3-8b", "tiny-moe"]


@pytest.fixture(scope="module")
def archs():
    return {name: load_architecture(name) for name in BUNDLED}


def test_bundled_names():
    assert set(BUNDLED) <= set(list_bundled())
    assert {"qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "llama", "mistral", "qwen2", "qwen3"} <= set(
        supported_model_types()
    )


# ------------------------------------------------------------------------------------------------------------------
# Counts and totals
# ------------------------------------------------------------------------------------------------------------------
def _qwen3_moe_expected(c):
    h, L, E, i = c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["moe_intermediate_size"]
    hd, nh, nkv, v = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    # per layer: 2 norms + q,k,v,o + q_norm,k_norm + router + 3 per expert
    count = 3 + L * (8 + 1 + 3 * E)
    attn = h * nh * hd * 2 + h * nkv * hd * 2 + 2 * hd
    params = 2 * v * h + h + L * (2 * h + attn + E * h + E * 3 * h * i)
    return count, params


def test_tiny_moe(archs):
    a = archs["tiny-moe"]
    count, params = _qwen3_moe_expected(a.config)
    assert (len(a.tensors), a.total_params) == (count, params) == (135, 1_783_168)
    assert (a.model_type, a.num_layers, a.num_experts, a.num_mtp_layers, a.hidden_size) == ("qwen3_moe", 4, 8, 0, 128)


def test_qwen3_30b_a3b(archs):
    a = archs["qwen3-30b-a3b"]
    count, params = _qwen3_moe_expected(a.config)
    assert len(a.tensors) == count == 18_867
    assert a.total_params == params
    assert 30.4e9 < a.total_params < 30.6e9  # model card: 30.5B
    by = a.by_name()
    assert by["model.layers.47.mlp.experts.127.down_proj.weight"].shape == (2048, 768)
    assert by["model.layers.0.self_attn.q_proj.weight"].shape == (4096, 2048)
    assert by["model.layers.0.self_attn.k_proj.weight"].shape == (512, 2048)
    assert by["model.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert by["lm_head.weight"].shape == (151936, 2048)
    assert not any("shared_expert" in n for n in by)
    assert all(t.dtype == "bfloat16" for t in a.tensors)


def test_deepseek_v3_counts_and_params(archs):
    a = archs["deepseek-v3"]
    assert (a.num_layers, a.num_mtp_layers, a.num_experts, a.num_shared_experts, a.first_dense_layers) == (
        61, 1, 256, 1, 3)
    # dense layer: input_ln, q_a, q_a_ln, q_b, kv_a, kv_a_ln, kv_b, o, post_ln + 3 MLP = 12
    # MoE layer:   9 + router weight + router bias + 256*3 experts + 3 shared = 782
    # MTP:         MoE layer + embed_tokens, enorm, hnorm, eh_proj, shared_head.{norm,head} = 788
    assert len(a.tensors) == 3 + 3 * 12 + 58 * 782 + 788 == 46_183
    main = sum(t.numel for t in a.tensors if t.mtp is None)
    mtp = sum(t.numel for t in a.tensors if t.mtp is not None)
    experts = sum(t.numel for t in a.tensors if t.mtp is None and t.role.split(".")[0] in ("routed_experts",
                                                                                            "shared_experts"))
    assert experts == (61 - 3) * (256 + 1) * 3 * 7168 * 2048  # 656.5B
    assert 670.5e9 < main < 671.5e9  # model card: 671B main model
    # MTP module: 11.5B unique + its own copies of embedding and head (0.93B each) in the checkpoint
    assert 13.3e9 < mtp < 13.6e9
    assert a.total_params == main + mtp


def test_deepseek_v3_names(archs):
    by = archs["deepseek-v3"].by_name()
    t = by["model.layers.0.self_attn.q_a_proj.weight"]
    assert (t.shape, t.role, t.megatron_name, t.sglang_prefix, t.fused_group) == (
        (1536, 7168), "attn.q_a", "decoder.layers.0.self_attention.linear_q_down_proj.weight",
        "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "q_a+kv_a")
    t = by["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert (t.shape, t.megatron_name, t.sglang_prefix, t.fused_group) == (
        (576, 7168), "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
        "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "q_a+kv_a")
    t = by["model.layers.0.self_attn.q_b_proj.weight"]
    assert (t.shape, t.megatron_name, t.sglang_prefix) == (
        (128 * 192, 1536), "decoder.layers.0.self_attention.linear_q_up_proj.weight",
        "model.layers.0.self_attn.q_b_proj")
    t = by["model.layers.0.self_attn.kv_b_proj.weight"]
    assert (t.shape, t.megatron_name, t.sglang_prefix) == (
        (128 * 256, 512), "decoder.layers.0.self_attention.linear_kv_up_proj.weight",
        "model.layers.0.self_attn.kv_b_proj")
    assert by["model.layers.0.self_attn.o_proj.weight"].shape == (7168, 128 * 128)
    assert by["model.layers.0.self_attn.q_a_layernorm.weight"].megatron_name == (
        "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight")
    assert by["model.layers.0.self_attn.kv_a_layernorm.weight"].megatron_name == (
        "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight")
    assert by["model.layers.0.input_layernorm.weight"].megatron_name == "decoder.layers.0.input_layernorm.weight"
    # dense layers 0-2, MoE from 3
    assert by["model.layers.2.mlp.gate_proj.weight"].shape == (18432, 7168)
    assert by["model.layers.2.mlp.gate_proj.weight"].sglang_prefix == "model.layers.2.mlp.gate_up_proj"
    assert by["model.layers.2.post_attention_layernorm.weight"].megatron_name == (
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight")
    assert by["model.layers.3.post_attention_layernorm.weight"].megatron_name == (
        "decoder.layers.3.pre_mlp_layernorm.weight")
    assert "model.layers.3.mlp.gate_proj.weight" not in by
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" not in by
    t = by["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert (t.shape, t.dtype, t.role, t.megatron_name, t.sglang_prefix) == (
        (256,), "float32", "router.bias", "decoder.layers.3.mlp.router.expert_bias", None)
    t = by["model.layers.60.mlp.experts.255.up_proj.weight"]
    assert (t.shape, t.expert, t.layer, t.megatron_name, t.megatron_part, t.sglang_prefix, t.fused_group) == (
        (2048, 7168), 255, 60, "decoder.layers.60.mlp.experts.linear_fc1.weight255", "up",
        "model.layers.60.mlp.experts", "experts.gate_up")
    t = by["model.layers.60.mlp.shared_experts.gate_proj.weight"]
    assert (t.shape, t.role, t.megatron_name, t.megatron_part, t.sglang_prefix, t.fused_group) == (
        (2048, 7168), "shared_experts.gate", "decoder.layers.60.mlp.shared_experts.linear_fc1.weight", "gate",
        "model.layers.60.mlp.shared_experts.gate_up_proj", "shared_experts.gate_up")
    assert by["model.layers.60.mlp.shared_experts.down_proj.weight"].sglang_prefix == (
        "model.layers.60.mlp.shared_experts.down_proj")


def test_deepseek_v3_mtp(archs):
    a = archs["deepseek-v3"]
    by = a.by_name()
    mtp = [t for t in a.tensors if t.mtp is not None]
    assert len(mtp) == 788
    assert all(t.mtp == 0 and t.layer is None and t.hf_name.startswith("model.layers.61.") for t in mtp)
    assert not any(t.hf_name.startswith("model.layers.61.") for t in a.tensors if t.mtp is None)
    expect = {
        "model.layers.61.embed_tokens.weight": ((129280, 7168), "mtp.embedding", None, None),
        "model.layers.61.enorm.weight": ((7168,), "norm.mtp", "mtp.layers.0.enorm.weight", None),
        "model.layers.61.hnorm.weight": ((7168,), "norm.mtp", "mtp.layers.0.hnorm.weight", None),
        "model.layers.61.eh_proj.weight": ((7168, 14336), "mtp.eh_proj", "mtp.layers.0.eh_proj.weight", None),
        "model.layers.61.shared_head.norm.weight": ((7168,), "norm.mtp", "mtp.layers.0.final_layernorm.weight",
                                                    None),
        "model.layers.61.shared_head.head.weight": ((129280, 7168), "mtp.lm_head", None, "model.shared_head.head"),
        "model.layers.61.self_attn.q_a_proj.weight": (
            (1536, 7168), "attn.q_a", "mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight",
            "model.decoder.self_attn.fused_qkv_a_proj_with_mqa"),
        "model.layers.61.mlp.experts.7.down_proj.weight": (
            (7168, 2048), "routed_experts.down", "mtp.layers.0.transformer_layer.mlp.experts.linear_fc2.weight7",
            "model.decoder.mlp.experts"),
    }
    for name, (shape, role, meg, sg) in expect.items():
        t = by[name]
        assert (t.shape, t.role, t.megatron_name, t.sglang_prefix) == (shape, role, meg, sg), name


def test_dense_models(archs):
    for name, expect_params in (("llama-3.2-1b", 1_235_814_400), ("qwen3-0.6b", 596_049_920)):
        a = archs[name]
        c = a.config
        h, L, i, v = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
        hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        qk_norm = a.model_type == "qwen3"
        per_layer = 2 + 4 + 3 + 2 * qk_norm
        assert len(a.tensors) == 2 + L * per_layer  # embed + final norm, no lm_head (tied)
        params = v * h + h + L * (2 * h + 2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * i + 2 * hd * qk_norm)
        assert a.total_params == params == expect_params
        by = a.by_name()
        assert "lm_head.weight" not in by  # tie_word_embeddings: the checkpoint has no lm_head
        t = by["model.layers.1.self_attn.v_proj.weight"]
        assert (t.role, t.megatron_name, t.megatron_part, t.sglang_prefix, t.fused_group) == (
            "attn.v", "decoder.layers.1.self_attention.linear_qkv.weight", "v", "model.layers.1.self_attn.qkv_proj",
            "qkv")
        t = by["model.layers.1.mlp.up_proj.weight"]
        assert (t.shape, t.megatron_name, t.megatron_part, t.sglang_prefix, t.fused_group) == (
            (i, h), "decoder.layers.1.mlp.linear_fc1.weight", "up", "model.layers.1.mlp.gate_up_proj", "gate_up")
        assert by["model.layers.1.input_layernorm.weight"].megatron_name == (
            "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight")
        assert by["model.norm.weight"].megatron_name == "decoder.final_layernorm.weight"
        assert by["model.embed_tokens.weight"].megatron_name == "embedding.word_embeddings.weight"


def test_top_level_names(archs):
    by = archs["qwen3-30b-a3b"].by_name()
    t = by["lm_head.weight"]
    assert (t.role, t.megatron_name, t.sglang_prefix, t.layer) == ("lm_head", "output_layer.weight", "lm_head", None)
    t = by["model.embed_tokens.weight"]
    assert (t.role, t.sglang_prefix, t.layer) == ("embedding", None, None)
    t = by["model.layers.5.mlp.gate.weight"]
    assert (t.role, t.megatron_name, t.sglang_prefix, t.shape) == (
        "router.weight", "decoder.layers.5.mlp.router.weight", None, (128, 2048))
    t = by["model.layers.5.self_attn.k_norm.weight"]
    assert (t.role, t.megatron_name) == ("norm.k", "decoder.layers.5.self_attention.k_layernorm.weight")
    t = by["model.layers.5.mlp.experts.3.gate_proj.weight"]
    assert (t.megatron_name, t.megatron_part, t.expert) == (
        "decoder.layers.5.mlp.experts.linear_fc1.weight3", "gate", 3)


# ------------------------------------------------------------------------------------------------------------------
# Invariants over every bundled architecture
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUNDLED)
def test_invariants(archs, name):
    a = archs[name]
    names = [t.hf_name for t in a.tensors]
    assert len(names) == len(set(names)), "duplicate HF names"
    meg = [(t.megatron_name, t.megatron_part) for t in a.tensors if t.megatron_name]
    assert len(meg) == len(set(meg)), "two HF tensors map onto the same Megatron slice"
    groups = defaultdict(list)
    for t in a.tensors:
        assert t.role in ROLES, t.hf_name
        assert t.dtype in ("bfloat16", "float16", "float32")
        assert all(isinstance(d, int) and d > 0 for d in t.shape)
        if t.is_linear:
            assert len(t.shape) == 2 and t.hf_name.endswith(".weight"), t.hf_name
        elif t.role not in ("embedding", "mtp.embedding", "router.weight", "shared_experts.gate_weight"):
            assert len(t.shape) == 1, t.hf_name
        if t.sglang_prefix is not None:
            assert t.is_linear, f"{t.hf_name}: only quantizable linears get an SGLang prefix"
        if t.expert is not None:
            assert t.role.startswith("routed_experts.")
        if t.megatron_part is not None:
            assert t.megatron_part in ("q", "k", "v", "gate", "up")
        if t.fused_group:
            assert t.role in FUSED_SIBLINGS[t.fused_group]
            groups[(t.layer, t.expert, t.mtp, t.fused_group)].append(t)
        if t.layer is not None:
            assert t.hf_name.startswith(f"model.layers.{t.layer}.")
            assert t.megatron_name is None or t.megatron_name.startswith(f"decoder.layers.{t.layer}.")
    for (layer, expert, mtp, group), members in groups.items():
        assert sorted(t.role for t in members) == sorted(FUSED_SIBLINGS[group]), (layer, expert, mtp, group)
        assert len({t.sglang_prefix for t in members}) == 1  # one fused SGLang module
        # Megatron fuses q/k/v and gate/up into one parameter; MLA q_a / kv_a stay two parameters in 0.16
        # (linear_qkv_down_proj fusion exists only in later Megatron-LM).
        assert len({t.megatron_name for t in members if t.megatron_name}) == (2 if group == "q_a+kv_a" else 1)
    assert a.by_name()["model.norm.weight"].role == "norm.final"
    assert LINEAR_ROLES <= set(ROLES)


def test_group_helpers(archs):
    a = archs["deepseek-v3"]
    groups = fused_groups(a)
    # per MoE layer: q_a+kv_a, 256 expert gate/up pairs, shared gate/up; dense layer: q_a+kv_a, gate_up; + MTP block
    assert len(groups) == 58 * (1 + 256 + 1) + 3 * 2 + (1 + 256 + 1)
    assert [t.role for t in groups[(3, 17, None, "experts.gate_up")]] == ["routed_experts.gate", "routed_experts.up"]
    assert [t.role for t in groups[(None, None, 0, "q_a+kv_a")]] == ["attn.q_a", "attn.kv_a"]
    mods = sglang_modules(a)
    assert len(mods["model.layers.3.mlp.experts"]) == 256 * 3
    assert [t.role for t in mods["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"]] == ["attn.q_a", "attn.kv_a"]
    assert len(mods["model.decoder.mlp.experts"]) == 256 * 3  # the MTP block in SGLang's NextN draft model
    params = megatron_params(archs["qwen3-30b-a3b"])
    assert [t.megatron_part for t in params["decoder.layers.0.self_attention.linear_qkv.weight"]] == ["q", "k", "v"]
    assert [t.megatron_part for t in params["decoder.layers.0.mlp.experts.linear_fc1.weight5"]] == ["gate", "up"]


def test_tensorinfo_objects_are_valid_models(archs):
    """The fast constructor produces objects identical to model_construct and that pass full validation."""
    for t in archs["deepseek-v3"].tensors[::997]:
        assert TensorInfo.model_validate(t.model_dump()) == t
        assert TensorInfo.model_construct(**dict(t)) == t  # dict(t): field values (source_format stays a model)
        assert t.model_fields_set == set(TensorInfo.model_fields)
    assert _emit._construct.__name__ == "construct_unvalidated"  # pydantic internals still match; else it falls back


def test_load_by_path_and_directory(tmp_path):
    a = load_architecture("tiny-moe")
    from precision_dsl.resources import models_dir

    cfg = models_dir() / "tiny-moe" / "config.json"
    by_file = load_architecture(str(cfg))
    by_dir = load_architecture(str(cfg.parent))
    assert by_file.tensors == by_dir.tensors == a.tensors
    assert by_file.name == str(cfg)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(cfg.read_text())
    assert load_architecture(ckpt).tensors == a.tensors  # PathLike accepted


def test_hf_repo_ids_resolve_to_bundled_configs():
    for repo_id, name in (("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"), ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
                          ("meta-llama/Llama-3.2-1B", "llama-3.2-1b"), ("Qwen/Qwen3-0.6B", "qwen3-0.6b")):
        a = load_architecture(repo_id)
        assert a.name == name and a.config == load_architecture(name).config


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_weights_match_catalog(name):
    """Where a bundle ships safetensors weights (tiny-moe), their names/shapes/dtypes are exactly the catalog's."""
    from precision_dsl.resources import models_dir

    files = sorted((models_dir() / name).glob("*.safetensors"))
    if not files:
        pytest.skip(f"bundle {name} ships no safetensors weights")
    import safetensors
    found = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="numpy") as fh:  # header only; no pickle
            for key in fh.keys():
                sl = fh.get_slice(key)
                found[key] = (tuple(sl.get_shape()), sl.get_dtype())
    expect = {t.hf_name: (t.shape, {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[t.dtype])
              for t in load_architecture(name).tensors}
    assert found == expect


def test_variants_structure():
    base = json.loads(json.dumps(load_architecture("tiny-moe").config))
    a = architecture_from_config({**base, "mlp_only_layers": [0], "decoder_sparse_step": 1}, "x")
    by = a.by_name()
    assert "model.layers.0.mlp.gate_proj.weight" in by and "model.layers.0.mlp.gate.weight" not in by
    assert by["model.layers.0.post_attention_layernorm.weight"].megatron_name == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    assert a.first_dense_layers == 1
    q2 = {**base, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 64}
    by = architecture_from_config(q2, "q2").by_name()
    t = by["model.layers.1.mlp.shared_expert.up_proj.weight"]
    assert (t.shape, t.role, t.sglang_prefix, t.megatron_name, t.megatron_part) == (
        (64, 128), "shared_experts.up", "model.layers.1.mlp.shared_expert.gate_up_proj",
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "up")
    t = by["model.layers.1.mlp.shared_expert_gate.weight"]
    assert (t.shape, t.role, t.sglang_prefix, t.megatron_name) == (
        (1, 128), "shared_experts.gate_weight", None, "decoder.layers.1.mlp.shared_experts.gate_weight")
    t = by["model.layers.1.self_attn.k_proj.bias"]
    assert (t.shape, t.role, t.megatron_name, t.megatron_part, t.is_linear) == (
        (64,), "bias.attn", "decoder.layers.1.self_attention.linear_qkv.bias", "k", False)
    ds = json.loads(json.dumps(load_architecture("deepseek-v3").config))
    lite = {**ds, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None, "num_hidden_layers": 2, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
            "topk_method": "greedy"}
    by = architecture_from_config(lite, "lite").by_name()
    t = by["model.layers.1.self_attn.q_proj.weight"]
    assert (t.role, t.megatron_name, t.sglang_prefix, t.fused_group) == (
        "attn.q", "decoder.layers.1.self_attention.linear_q_proj.weight", "model.layers.1.self_attn.q_proj", None)
    t = by["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert (t.sglang_prefix, t.fused_group) == ("model.layers.1.self_attn.kv_a_proj_with_mqa", None)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in by  # V2 greedy routing has no score bias


# ------------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------------
def _err(arg) -> ArchitectureError:
    with pytest.raises(ArchitectureError) as info:
        load_architecture(arg)
    err = info.value
    assert isinstance(err, ValueError) and err.hint and err.hint in str(err)
    return err


def _write(tmp_path, content: str):
    p = tmp_path / "config.json"
    p.write_text(content)
    return str(p)


def test_unknown_name_and_missing_paths(tmp_path):
    assert "not a bundled model" in _err("qwen9-1t").message and "tiny-moe" in _err("qwen9-1t").hint
    assert "no config.json" in _err(str(tmp_path)).message
    assert "not a bundled model" in _err(str(tmp_path / "nope.json")).message
    _err("")


def test_invalid_json_has_line_and_column(tmp_path):
    path = _write(tmp_path, '{\n  "model_type": "qwen3_moe",\n  "hidden_size": 12,,\n}')
    err = _err(path)
    assert f"{path}:3:" in err.message and "invalid JSON" in err.message
    assert "top level is a JSON list" in _err(_write(tmp_path, "[1, 2]")).message
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00")
    assert "UTF-8" in _err(str(tmp_path / "config.json")).message


def test_model_type_errors(tmp_path):
    assert "neither 'architectures' nor 'model_type'" in _err(_write(tmp_path, '{"hidden_size": 8}')).message
    err = _err(_write(tmp_path, '{"model_type": "gpt2"}'))
    assert "unsupported model: architectures None, model_type 'gpt2'" in err.message and "qwen3_moe" in err.hint
    assert "DeepseekV3ForCausalLM" in err.hint and "Glm4MoeForCausalLM" in err.hint
    err = _err(_write(tmp_path, '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'))
    assert "architectures ['GPT2LMHeadModel'], model_type 'gpt2'" in err.message  # names both
    assert "must be a string" in _err(_write(tmp_path, '{"model_type": 3}')).message
    assert "list of class names" in _err(_write(tmp_path, '{"architectures": "Qwen3ForCausalLM"}')).message


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "2048"}, "hidden_size"),
        ({"hidden_size": 2048.5}, "hidden_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"hidden_size": 10**9}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "exceeds num_experts"),
        ({"torch_dtype": "int4"}, "torch_dtype"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ],
)
def test_invalid_fields(tmp_path, change, needle):
    raw = dict(load_architecture("tiny-moe").config)
    for k, v in change.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    err = _err(_write(tmp_path, json.dumps(raw)))
    assert needle in err.message and "config.json" in err.message


def test_missing_field_is_named(tmp_path):
    raw = dict(load_architecture("deepseek-v3").config)
    del raw["kv_lora_rank"]
    assert "field 'kv_lora_rank' is missing" in _err(_write(tmp_path, json.dumps(raw))).message


def test_absurd_sizes_fail_fast(tmp_path):
    raw = dict(load_architecture("tiny-moe").config, num_hidden_layers=1000, num_experts=4000, num_experts_per_tok=2)
    t0 = time.process_time()
    err = _err(_write(tmp_path, json.dumps(raw)))
    assert "tensors" in err.message and time.process_time() - t0 < 1.0  # rejected before building
    raw = dict(load_architecture("llama-3.2-1b").config, hidden_size=65536, intermediate_size=1_000_000,
               num_hidden_layers=1000, num_attention_heads=64, num_key_value_heads=8, head_dim=1024)
    assert "parameters" in _err(_write(tmp_path, json.dumps(raw))).message


def test_oversized_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama", "pad": "' + "x" * (17 * 1024 * 1024) + '"}')
    assert "too large" in _err(str(p)).message


# ------------------------------------------------------------------------------------------------------------------
# Speed (requirement: DeepSeek-V3, ~46k tensors, < 0.3 s CPU)
# ------------------------------------------------------------------------------------------------------------------
def test_deepseek_v3_loads_fast():
    load_architecture("deepseek-v3")  # warm imports / file cache
    best = min(_cpu_time(lambda: load_architecture("deepseek-v3")) for _ in range(3))
    assert best < 0.3, f"load_architecture('deepseek-v3') took {best:.3f} s CPU"


def _cpu_time(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def test_bundled_qwen3_8b_is_the_published_file():
    """Byte-identical to Qwen/Qwen3-8B@b968826d config.json (the SHA-256 a public repository pins for that file)."""
    import hashlib

    from precision_dsl.resources import models_dir

    data = (models_dir() / "qwen3-8b" / "config.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == "f7c4eadfbbf522470667b797a3c89be2524832d2d599797248dc304fff447c30"
