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

torch = pytest.importorskip("torch", reason="torch is needed for the meta-device oracle")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the meta-device oracle needs it (pip install transformers)"
)

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
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _meta_model(raw: dict):
    cfg_dict = {k: v for k, v in copy.deepcopy(raw).items() if k not in _NOT_ARCH_KEYS}
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
    model = _meta_model(arch.config)
    runtime = _runtime_tensors(model)
    theirs = _checkpoint_view(model, runtime)
    ours = {t.hf_name: t for t in arch.tensors if t.mtp is None}

    assert sorted(set(theirs) - set(ours)) == [], "transformers has tensors the catalog lacks"
    assert sorted(set(ours) - set(theirs)) == [], "catalog has tensors transformers lacks"
    for hf_name, t in ours.items():
        assert tuple(theirs[hf_name].shape) == t.shape, hf_name
        expected_dtype = _dtype_name(theirs[hf_name])
        if arch.model_type.startswith("deepseek") and hf_name.endswith("mlp.gate.weight"):
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


def test_mtp_is_not_built_by_transformers_but_mirrors_a_decoder_layer():
    """transformers ignores MTP; check the catalog's MTP block structurally against the last decoder layer."""
    arch = architecture_from_config(VARIANTS["deepseek-v3-small"], "deepseek-v3-small")
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
