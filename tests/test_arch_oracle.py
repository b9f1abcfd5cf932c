"""Meta-device oracle: transformers builds the same architectures and must agree with our catalog name for name.

How (checked with transformers 5.24.0): `AutoModelForCausalLM.from_config(cfg)` under `torch.device("meta")` (no
memory, full sizes are cheap), then `transformers.core_model_loading.revert_weight_conversion(model, state_dict)`,
which is what `save_pretrained` uses to turn transformers' runtime names back into checkpoint names. Fusion in
transformers 5.x: Qwen2-MoE / Qwen3-MoE / DeepSeek-V2/V3 experts are runtime 3-D parameters
`mlp.experts.gate_up_proj` [E, 2*I, H] (gate rows first, then up) and `mlp.experts.down_proj` [E, H, I]; the reverse
conversion unbinds them into per-expert `mlp.experts.E.{gate,up,down}_proj.weight`. We check both: that the reverted
names/shapes equal ours exactly, and that our per-expert shapes stack into the runtime 3-D shapes.
transformers 4.x (no revert_weight_conversion) already uses per-expert names at runtime; then state_dict is used as is.

Documented differences we allow:
  * MTP (`model.layers.{num_hidden_layers+k}.*`): transformers does not build it (DeepSeek-V3 ignores those keys).
  * Tied embeddings: state_dict repeats lm_head.weight; checkpoints (and named_parameters) do not.
  * DeepSeek `mlp.gate.weight`: transformers keeps it FP32 at runtime (`_keep_in_fp32_modules_strict`); the
    checkpoint stores it in torch_dtype, which is what we record.
"""

from __future__ import annotations

import copy
import re

import pytest

from precision_dsl.arch import architecture_from_config, list_bundled, load_architecture

import torch  # noqa: E402  (the oracles are in the test extra: a missing one fails, never skips)
import transformers  # noqa: E402

# Small variants that exercise every structural branch of the adapters (biases, dense layers inside MoE models,
# decoder_sparse_step, Qwen2-MoE shared expert, MLA without q-LoRA, moe_layer_freq, head_dim absent).
VARIANTS: dict[str, dict] = {
    "qwen2-bias": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mistral-no-head-dim": {
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 50, "head_dim": None,
        "torch_dtype": "bfloat16",
    },
    "llama-biases": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 50, "attention_bias": True,
        "mlp_bias": True, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "qwen3-moe-sparse-step": {
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3],
        "vocab_size": 50, "torch_dtype": "bfloat16",
    },
    "qwen2-moe-shared": {
        "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
        "vocab_size": 50, "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite-like": {
        "model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
        "n_shared_experts": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 50,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "torch_dtype": "bfloat16",
    },
    "glm4-moe-small": {  # GLM-4.5 layout: qk-norm, qkv bias, head_dim != hidden/heads, dense first layer, MTP
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "use_qk_norm": True,
        "attention_bias": True, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1, "vocab_size": 50,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "glm4-moe-air-like": {  # GLM-4.5-Air layout: no qk-norm, two shared experts, no MTP
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
        "first_k_dense_replace": 2, "use_qk_norm": False, "attention_bias": True, "num_nextn_predict_layers": 0,
        "vocab_size": 50, "torch_dtype": "bfloat16",
    },
    "deepseek-v3-small": {
        "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 2, "q_lora_rank": 24,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 50,
        "n_group": 2, "topk_group": 1, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    },
}

# Keys of config.json that are metadata for remote code / the FP8 release, not architecture.
_NOT_ARCH_KEYS = ("auto_map", "quantization_config")
# transformers keeps these routers FP32 at runtime (`_keep_in_fp32_modules_strict`); checkpoints store torch_dtype.
_FP32_RUNTIME_ROUTER = ("deepseek_v2", "deepseek_v3", "glm4_moe")
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _meta_model(raw: dict, model_type: str = None):
    cfg_dict = {k: v for k, v in copy.deepcopy(raw).items() if k not in _NOT_ARCH_KEYS}
    if model_type:  # the family's transformers model_type (Kimi-K2's "kimi_k2" is DeepseekV3ForCausalLM)
        cfg_dict["model_type"] = model_type
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _runtime_tensors(model) -> dict:
    """Parameters (tied duplicates removed, as named_parameters does) + persistent buffers."""
    out = dict(model.named_parameters())
    for mod_name, mod in model.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


def _checkpoint_view(model, runtime: dict) -> dict:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: runtime names are checkpoint names
        return runtime
    return revert_weight_conversion(model, dict(runtime))


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


CASES = [(name, None) for name in list_bundled()] + [(name, raw) for name, raw in VARIANTS.items()]


@pytest.mark.parametrize("name,raw", CASES, ids=[c[0] for c in CASES])
def test_catalog_matches_transformers(name, raw):
    arch = load_architecture(name) if raw is None else architecture_from_config(raw, name)
    model = _meta_model(arch.config, arch.model_type)
    assert type(model).__name__ == (arch.architecture or type(model).__name__)
    runtime = _runtime_tensors(model)
    theirs = _checkpoint_view(model, runtime)
    ours = {t.hf_name: t for t in arch.tensors if t.mtp is None}

    assert sorted(set(theirs) - set(ours)) == [], "transformers has tensors the catalog lacks"
    assert sorted(set(ours) - set(theirs)) == [], "catalog has tensors transformers lacks"
    for hf_name, t in ours.items():
        assert tuple(theirs[hf_name].shape) == t.shape, hf_name
        expected_dtype = _dtype_name(theirs[hf_name])
        if arch.model_type in _FP32_RUNTIME_ROUTER and hf_name.endswith("mlp.gate.weight"):
            expected_dtype = t.dtype  # runtime FP32 router (documented above); checkpoint keeps torch_dtype
        assert t.dtype == expected_dtype, hf_name

    # Our per-expert tensors stack into transformers' fused runtime parameters.
    fused_seen = 0
    for rt_name, param in runtime.items():
        m = _FUSED_EXPERTS.match(rt_name)
        if not m:
            continue
        fused_seen += 1
        prefix, kind = m.groups()
        n_experts = param.shape[0]
        assert n_experts == arch.num_experts
        for e in range(n_experts):
            if kind == "gate_up_proj":
                gate, up = ours[f"{prefix}.{e}.gate_proj.weight"], ours[f"{prefix}.{e}.up_proj.weight"]
                assert (gate.shape[0] + up.shape[0], gate.shape[1]) == tuple(param.shape[1:])
            else:
                assert ours[f"{prefix}.{e}.down_proj.weight"].shape == tuple(param.shape[1:])
    moe_layers = {t.layer for t in ours.values() if t.role == "router.weight"}
    if "gate_up_proj" in "".join(runtime):  # transformers >= 5 fuses experts
        assert fused_seen == 2 * len(moe_layers)


@pytest.mark.parametrize("variant", ["deepseek-v3-small", "glm4-moe-small"])
def test_mtp_is_not_built_by_transformers_but_mirrors_a_decoder_layer(variant):
    """transformers ignores MTP; check the catalog's MTP block structurally against the last decoder layer."""
    arch = architecture_from_config(VARIANTS[variant], variant)
    model = _meta_model(arch.config)
    runtime_names = set(_checkpoint_view(model, _runtime_tensors(model)))
    mtp = [t for t in arch.tensors if t.mtp == 0]
    assert not any(t.hf_name in runtime_names for t in mtp)
    last = arch.num_layers - 1
    inner = {t.hf_name.removeprefix(f"model.layers.{arch.num_layers}."): t.shape for t in mtp}
    decoder = {
        n.removeprefix(f"model.layers.{last}."): tuple(p.shape)
        for n, p in _checkpoint_view(model, _runtime_tensors(model)).items()
        if n.startswith(f"model.layers.{last}.")
    }
    extra = {k: v for k, v in inner.items() if k not in decoder}
    h, v = arch.hidden_size, arch.config["vocab_size"]
    assert extra == {
        "embed_tokens.weight": (v, h), "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
    }
    assert {k: s for k, s in inner.items() if k in decoder} == decoder


# ------------------------------------------------------------------------------------------------------------------
# Megatron-core oracle (megatron-core 0.16.1, CPU, no TransformerEngine)
# ------------------------------------------------------------------------------------------------------------------
# Without TE only the *local* spec can be built, so the child process builds GPTModel with
# get_gpt_decoder_block_spec(use_transformer_engine=False) (+ get_gpt_mtp_block_spec) and translates the local
# names into the TE-spec names our catalog uses, by the rules Megatron itself defines:
#   * standard attention: input_layernorm -> self_attention.linear_qkv.layer_norm_weight (the local spec's own
#     sharded_state_dict_keys_map); dense MLP layers: pre_mlp_layernorm -> mlp.linear_fc1.layer_norm_weight (same
#     map; the TE dense spec has pre_mlp_layernorm=IdentityOp, the TE MoE spec keeps it);
#   * MLA with qk_layernorm: q_layernorm / kv_layernorm -> linear_q_up_proj / linear_kv_up_proj .layer_norm_weight
#     (TE MLA spec builds the up-projections as column_parallel_layer_norm_linear);
#   * experts: SequentialMLP local_experts.E.linear_fcX.weight -> TEGroupedMLP linear_fcX.weight{E}.
# Everything else (module paths, router/expert_bias, shared_experts, MTP enorm/hnorm/eh_proj/transformer_layer/
# final_layernorm, shapes) is compared as built. Runs in a subprocess: it initialises torch.distributed (gloo) and
# stubs torch.cuda.current_device / TE placeholders, which must not leak into the test session.
_MEGATRON_CHILD = r'''
import json, os, re, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
specs = json.loads(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(specs["port"]))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
torch.cuda.current_device = lambda: "cpu"  # router expert_bias asks for the CUDA device
import megatron.core.transformer.multi_latent_attention as mla
for n in dir(mla):  # TE classes are MagicMock placeholders without TE; isinstance() needs real types
    if n.startswith("TE") and type(getattr(mla, n)).__name__ == "MagicMock":
        setattr(mla, n, type(n, (), {}))
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
result = {}
for case, spec in specs["cases"].items():
    kw = spec["config"]
    mla_on = kw.get("multi_latent_attention")
    cfg = (MLATransformerConfig if mla_on else TransformerConfig)(use_cpu_initialization=True, **kw)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    if mla_on:  # local DotProductAttention rejects MLA's k_channels; core attention has no parameters
        for ls in block.layer_specs:
            ls.submodules.self_attention.submodules.core_attention = IdentityOp
    mtp = (get_gpt_mtp_block_spec(cfg, block.layer_specs[-1], use_transformer_engine=False)
           if kw.get("mtp_num_layers") else None)
    model = GPTModel(cfg, block, vocab_size=spec["vocab"], max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=spec["tied"], mtp_block_spec=mtp)
    result[case] = {n: list(t.shape) for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
print("MEGATRON_NAMES=" + json.dumps(result))
'''


def _megatron_kwargs(arch) -> dict:
    """HF config -> TransformerConfig kwargs (only what changes parameter names/shapes)."""
    c = arch.config
    h = c["hidden_size"]
    by = arch.by_name()
    moe_layers = sorted({t.layer for t in arch.tensors if t.role == "router.weight" and t.layer is not None})
    kw = dict(num_layers=arch.num_layers, hidden_size=h, ffn_hidden_size=c["intermediate_size"],
              num_attention_heads=c["num_attention_heads"], normalization="RMSNorm", gated_linear_unit=True,
              add_bias_linear=bool(c.get("attention_bias") and c.get("mlp_bias")))
    if arch.num_experts:
        kw.update(num_moe_experts=arch.num_experts, moe_router_topk=c.get("num_experts_per_tok", 2),
                  moe_layer_freq=[int(n in moe_layers) for n in range(arch.num_layers)],
                  moe_ffn_hidden_size=c["moe_intermediate_size"])
    if any(t.role == "router.bias" for t in arch.tensors):
        kw.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    shared = [t for t in arch.tensors if t.role == "shared_experts.gate" and t.mtp is None]
    if shared:
        kw["moe_shared_expert_intermediate_size"] = shared[0].shape[0]
        kw["moe_shared_expert_gate"] = any(t.role == "shared_experts.gate_weight" for t in arch.tensors)
    if arch.num_mtp_layers:
        kw["mtp_num_layers"] = arch.num_mtp_layers
    if arch.model_type.startswith("deepseek"):
        kw.update(multi_latent_attention=True, q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"],
                  qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"],
                  v_head_dim=c["v_head_dim"], qk_layernorm=True, rope_type="rope")
    else:
        kw.update(num_query_groups=c.get("num_key_value_heads") or c["num_attention_heads"],
                  kv_channels=by["model.layers.0.self_attn.k_proj.weight"].shape[0]
                  // (c.get("num_key_value_heads") or c["num_attention_heads"]),
                  qk_layernorm="model.layers.0.self_attn.q_norm.weight" in by,
                  add_qkv_bias="model.layers.0.self_attn.q_proj.bias" in by and not kw["add_bias_linear"])
    return kw


def _megatron_te_names(local: dict, dense_layers: set, mla: bool) -> dict:
    out = {}
    for name, shape in local.items():
        if name == "embedding.position_embeddings.weight":
            continue
        m = re.match(r"^((?:decoder\.layers\.(\d+))|(?:mtp\.layers\.\d+\.transformer_layer))\.(.*)$", name)
        if m:
            prefix, layer, rest = m.groups()
            dense = layer is not None and int(layer) in dense_layers
            if rest == "input_layernorm.weight" and not mla:
                rest = "self_attention.linear_qkv.layer_norm_weight"
            elif rest == "pre_mlp_layernorm.weight" and dense:
                rest = "mlp.linear_fc1.layer_norm_weight"
            elif mla and rest == "self_attention.q_layernorm.weight":
                rest = "self_attention.linear_q_up_proj.layer_norm_weight"
            elif mla and rest == "self_attention.kv_layernorm.weight":
                rest = "self_attention.linear_kv_up_proj.layer_norm_weight"
            else:
                e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", rest)
                if e:
                    rest = f"mlp.experts.{e.group(2)}.weight{e.group(1)}"
            name = f"{prefix}.{rest}"
        out[name] = tuple(shape)
    return out


def _catalog_megatron_view(arch) -> dict:
    """Our tensors grouped by megatron_name; fused parameters stack their parts along dim 0."""
    grouped: dict[str, list] = {}
    for t in arch.tensors:
        if t.megatron_name:
            grouped.setdefault(t.megatron_name, []).append(t)
    out = {}
    for name, parts in grouped.items():
        first = parts[0].shape
        out[name] = (sum(p.shape[0] for p in parts),) + first[1:] if len(parts) > 1 else first
    return out


MEGATRON_CASES = ["tiny-moe", "deepseek-v3-small", "qwen2-moe-shared", "llama-biases", "qwen2-bias", "glm4-moe-small",
                  "glm4-moe-air-like"]


def _case_arch(name):
    return load_architecture(name) if name in list_bundled() else architecture_from_config(VARIANTS[name], name)


@pytest.fixture(scope="module")
def megatron_names() -> dict:
    """Build every case in ONE child process (importing megatron.core costs ~7 s)."""
    import json
    import os
    import subprocess
    import sys

    cases = {}
    for name in MEGATRON_CASES:
        arch = _case_arch(name)
        cases[name] = {"config": _megatron_kwargs(arch), "vocab": arch.config["vocab_size"],
                       "tied": bool(arch.config.get("tie_word_embeddings"))}
    payload = json.dumps({"cases": cases, "port": 29500 + os.getpid() % 400})
    proc = subprocess.run([sys.executable, "-c", _MEGATRON_CHILD, payload], capture_output=True, text=True,
                          timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MEGATRON_NAMES=")), None)
    assert line is not None, f"megatron child failed:\n{proc.stderr[-3000:]}"
    return json.loads(line.removeprefix("MEGATRON_NAMES="))


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_megatron_names_match_megatron_core(megatron_names, name):
    arch = _case_arch(name)
    by = arch.by_name()
    dense_layers = {n for n in range(arch.num_layers) if f"model.layers.{n}.mlp.gate.weight" not in by}
    theirs = _megatron_te_names(megatron_names[name], dense_layers, mla=arch.model_type.startswith("deepseek"))
    ours = _catalog_megatron_view(arch)
    assert sorted(set(theirs) - set(ours)) == []
    assert sorted(set(ours) - set(theirs)) == []
    assert {k: v for k, v in ours.items() if theirs[k] != v} == {}


# ------------------------------------------------------------------------------------------------------------------
# Configs as transformers 5 writes them (save_pretrained): attribute names differ from the public config.json
# ------------------------------------------------------------------------------------------------------------------
PUBLIC = ["kimi-k2", "deepseek-v3", "glm-4.5-air", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-8b", "llama-3.2-1b"]


@pytest.mark.parametrize("name", PUBLIC)
def test_config_saved_by_installed_transformers_loads_identically(tmp_path, name):
    import json

    arch = load_architecture(name)
    raw = {k: v for k, v in arch.config.items() if k != "auto_map"}
    raw["model_type"] = arch.model_type  # transformers knows Kimi-K2 as deepseek_v3 (it saves it so, too)
    transformers.AutoConfig.for_model(**raw).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    if int(transformers.__version__.split(".")[0]) >= 5:  # the renames this test exists for
        assert "dtype" in saved and "torch_dtype" not in saved
        if arch.model_type == "qwen3_moe":
            assert "num_local_experts" in saved and "num_experts" not in saved
        if arch.model_type == "glm4_moe":
            assert "partial_rotary_factor" not in saved and saved["rope_parameters"]["partial_rotary_factor"] == 0.5
    again = load_architecture(str(tmp_path))
    assert again.model_type == arch.model_type and again.num_mtp_layers == arch.num_mtp_layers
    key = [(t.hf_name, t.shape, t.dtype, t.role, t.megatron_name, t.sglang_prefix, t.source_format)
           for t in arch.tensors]
    assert [(t.hf_name, t.shape, t.dtype, t.role, t.megatron_name, t.sglang_prefix, t.source_format)
            for t in again.tensors] == key


def test_transformers5_alias_conflict_is_an_error():
    from precision_dsl.arch import ArchitectureError

    raw = dict(load_architecture("qwen3-30b-a3b").config)
    with pytest.raises(ArchitectureError, match="'num_local_experts' .* and 'num_experts' .* disagree"):
        architecture_from_config({**raw, "num_local_experts": 64}, "x")
    same = architecture_from_config({**raw, "num_local_experts": raw["num_experts"]}, "x")
    assert same.num_experts == raw["num_experts"]
