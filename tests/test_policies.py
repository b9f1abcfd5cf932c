"""Shipped policies: every file resolves against tiny-moe, qwen3-30b-a3b and deepseek-v3, and the recipes say
what the Miles ablations say (final 15% BF16, shared experts + MLA kv_b BF16, NVFP4 experts with per-token
activation scale, per-tensor weight scale shared by gate/up)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.precision import BackwardMode, FormatKind
from precision_dsl.resolve import resolve
from precision_dsl.resources import policies_dir

from conftest import SEED_POLICIES

POLICIES = sorted(p.name for p in policies_dir().glob("*.policy"))
MODELS = ["tiny-moe", "qwen3-30b-a3b", "deepseek-v3"]
DENSE_MODELS = ["qwen3-8b", "qwen3-0.6b", "llama-3.2-1b"]
# Recipes for dense models: their `mlp` rule needs dense MLP layers (Qwen3-MoE has none; DeepSeek-V3 its first 3).
DENSE_POLICIES = {"mxfp8-dense.policy", "nvfp4-dense.policy"}
# What resolves on a dense model: the dense recipes and those whose expert rules are optional.
FIT_DENSE = DENSE_POLICIES | {"bf16.policy", "fp8-blockwise-hopper.policy", "keep-bf16.policy"}
SEED_RECIPES = {  # conftest.SEED_POLICIES with the recipe each one must produce
    "bf16.policy": None,
    "mxfp8-e2e.policy": ("mxfp8", BackwardMode.QUANTIZED),
    "mxfp8-hp-backward.policy": ("mxfp8", BackwardMode.HIGH_PRECISION),
    "mxfp8-dequant-backward.policy": ("mxfp8", BackwardMode.DEQUANTIZED),
    "nvfp4-pertoken-hp-backward.policy": ("nvfp4", BackwardMode.HIGH_PRECISION),
    "nvfp4-pertoken-dequant-backward.policy": ("nvfp4", BackwardMode.DEQUANTIZED),
}


@lru_cache(maxsize=None)
def arch(name):
    return load_architecture(name)


@lru_cache(maxsize=3)  # a DeepSeek-V3 plan is ~70 MB: keep only the few reused by neighbouring tests
def plan(policy, model):
    return resolve(policies_dir() / policy, arch(model))


def test_seed_recipes_are_the_seed_policies():
    assert [p.removesuffix(".policy") for p in SEED_RECIPES] == list(SEED_POLICIES)


def test_all_expected_files_are_shipped():
    expected = set(SEED_RECIPES) | {"fp8-blockwise-hopper.policy", "nvfp4-weight-only.policy", "miles-nvfp4.policy", "language-tour.policy",
                                    "keep-bf16.policy"} | DENSE_POLICIES
    assert expected <= set(POLICIES)
    assert Path(policies_dir()).name == "policies"


RESOLVING = [(p, m) for p in POLICIES for m in MODELS if not (p in DENSE_POLICIES and m != "deepseek-v3")] \
    + [(p, m) for p in sorted(FIT_DENSE) for m in DENSE_MODELS]


@pytest.mark.parametrize("policy,model", RESOLVING)
def test_policy_resolves(policy, model):
    p = plan(policy, model)
    assert len(p.tensors) == len(arch(model).tensors)
    assert p.policy_files[0].endswith(policy)


@pytest.mark.parametrize("model", ["tiny-moe", "qwen3-30b-a3b", *DENSE_MODELS])
def test_fitting_policies_are_those_that_resolve(model):
    """engine.plans.fitting_policies (what `policyc arch` and `policyc run` say fits) judges on one routed expert
    per layer: the same answer as resolving on the whole model."""
    from precision_dsl.diagnostics import PolicyError
    from precision_dsl.engine.plans import fitting_policies

    full = []
    for name in POLICIES:
        if name == "keep-bf16.policy":  # an import fragment, not a recipe
            continue
        try:
            resolve(policies_dir() / name, arch(model))
        except PolicyError:
            continue
        full.append(name.removesuffix(".policy"))
    assert fitting_policies(arch(model)) == full
    assert {f"{p}.policy" for p in full} == (FIT_DENSE - {"keep-bf16.policy"} if model in DENSE_MODELS
                                             else set(POLICIES) - DENSE_POLICIES - {"keep-bf16.policy"})


@pytest.mark.parametrize("model", DENSE_MODELS)
def test_dense_recipes(model):
    """mxfp8-dense: every decoder GEMM MXFP8 (quantized backward); nvfp4-dense: the MLP NVFP4 with per-token
    activation scales and gate/up sharing one weight scale (dequantized backward). Both keep embeddings, lm_head,
    norms and the final 15% of layers BF16."""
    n = arch(model).num_layers
    tail = set(range(n - -(-15 * n // 100), n))
    for policy, kind, roles, backward in (("mxfp8-dense.policy", "mxfp8", ("attn.", "mlp."), BackwardMode.QUANTIZED),
                                          ("nvfp4-dense.policy", "nvfp4", ("mlp.",), BackwardMode.DEQUANTIZED)):
        p = plan(policy, model)
        for t in p.tensors:
            quantized = t.is_linear and t.layer is not None and t.layer not in tail and t.role.startswith(roles)
            if not quantized:
                assert t.weight.kind == FormatKind.BF16, (policy, t.hf_name, t.precision.short())
                continue
            assert t.weight.kind.value == kind and t.backward == backward, (policy, t.hf_name)
            if kind == "nvfp4":
                assert t.activation.global_scale == "row"
                assert (t.share_scale_group is not None) == (t.role in ("mlp.gate", "mlp.up")), t.hf_name


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", [p for p, r in SEED_RECIPES.items() if r])
def test_seed_recipes_keep_the_bf16_exceptions(policy, model):
    p = plan(policy, model)
    kind, backward = SEED_RECIPES[policy]
    n = p.num_layers
    tail = set(range(n - -(-15 * n // 100), n))  # ceil(0.15 n) final layers
    for t in p.tensors:
        if not t.is_linear:
            assert not t.weight.is_quantized
            continue
        expect_hp = (t.layer in tail or t.layer is None or t.mtp is not None or t.role.startswith("shared_experts")
                     or t.role == "attn.kv_b" or t.role.startswith("router"))
        if kind == "nvfp4":
            expect_hp = expect_hp or not t.role.startswith("routed_experts")
        if expect_hp:
            assert t.weight.kind == FormatKind.BF16, (t.hf_name, t.precision.short())
        else:
            assert t.weight.kind.value == kind and t.backward == backward, (t.hf_name, t.precision.short())


@pytest.mark.parametrize("policy", ["nvfp4-pertoken-hp-backward.policy", "nvfp4-pertoken-dequant-backward.policy"])
def test_nvfp4_recipes_scales(policy):
    p = plan(policy, "qwen3-30b-a3b")
    experts = [t for t in p.tensors if t.role.startswith("routed_experts") and t.weight.is_quantized]
    assert experts and all(t.activation.global_scale == "row" for t in experts)
    for t in experts:
        if t.role == "routed_experts.down":
            assert t.weight.global_scale == "tensor" and t.share_scale_group is None
        else:
            assert t.weight.global_scale == "group" and t.share_scale_group.endswith("{gate_proj,up_proj}")
    assert len(p.share_scale_groups) == 40 * 128  # 40 quantized layers x 128 experts


def test_qwen3_30b_final_15_percent_is_layers_40_to_47():
    p = plan("nvfp4-pertoken-hp-backward.policy", "qwen3-30b-a3b")
    hp = sorted({t.layer for t in p.tensors if t.role.startswith("routed_experts") and not t.weight.is_quantized})
    assert hp == list(range(40, 48))


def test_deepseek_v3_expert_parameter_accounting():
    """routed + shared experts of the 58 MoE decoder layers: (61-3)*(256+1)*3*7168*2048 = 656.5B of ~671B."""
    p = plan("nvfp4-pertoken-hp-backward.policy", "deepseek-v3")
    decoder = [t for t in p.tensors if t.mtp is None]
    experts = sum(t.numel for t in decoder if t.role.split(".")[0] in ("routed_experts", "shared_experts"))
    total = sum(t.numel for t in decoder)
    assert experts == (61 - 3) * (256 + 1) * 3 * 7168 * 2048
    assert round(experts / 1e9, 1) == 656.5 and round(total / 1e9) == 671
    assert round(100 * experts / total, 1) == 97.8
    # MTP experts exist and are separate: the routed_experts selector does not reach them
    mtp_experts = [t for t in p.tensors if t.mtp is not None and t.role.startswith("routed_experts")]
    assert mtp_experts and all(not t.weight.is_quantized for t in mtp_experts)
    # kv_b stays BF16 everywhere (MLA); the bf16 tail is 51..60
    assert all(not t.weight.is_quantized for t in p.tensors if t.role == "attn.kv_b")
    q_layers = sorted({t.layer for t in p.tensors if t.role.startswith("routed_experts") and t.weight.is_quantized})
    assert q_layers == list(range(3, 51))


def test_fp8_blockwise_targets_hopper_natively():
    p = plan("fp8-blockwise-hopper.policy", "deepseek-v3")
    assert p.target == "hopper" and not p.emulate
    q = [t for t in p.tensors if t.weight.is_quantized]
    assert q and {t.weight.kind for t in q} == {FormatKind.FP8_BLOCK}
    assert all(t.weight.block == (128, 128) and t.activation.block == (1, 128) for t in q)


def test_weight_only_and_tour():
    p = plan("nvfp4-weight-only.policy", "qwen3-30b-a3b")
    q = [t for t in p.tensors if t.weight.is_quantized]
    assert q and all(t.activation.kind == FormatKind.BF16 and t.weight.kind == FormatKind.NVFP4 for t in q)
    tour = plan("language-tour.policy", "deepseek-v3")
    by = tour.by_name()
    assert by["model.layers.3.mlp.experts.0.down_proj.weight"].weight.block == (16, 16)
    assert by["model.layers.3.mlp.experts.0.gate_proj.weight"].backward == BackwardMode.DEQUANTIZED
    assert by["model.layers.0.self_attn.q_a_proj.weight"].weight.kind == FormatKind.FP8_BLOCK
    assert by["model.layers.3.mlp.gate.weight"].decided_by.text.startswith('name("model.layers.*.mlp.gate.weight")')
    assert by["model.layers.60.mlp.experts.0.down_proj.weight"].weight.kind == FormatKind.BF16
