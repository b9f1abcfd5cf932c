"""vLLM's own code judges what policyc emits for it (tests/oracles/vllm_oracle.py).

For every shipped policy x {tiny-moe, qwen3-30b-a3b, deepseek-v3, glm-4.5-air} x rollout layouts that policyc does not
refuse, vLLM - given the model directory `policyc convert` writes (its config.json with the converter's
quantization_config, hf_quant_config.json where the converter writes one) and exactly the emitted engine args -
parses the args with its real parser, builds the quant config its loader builds (the `--hf-overrides`
quantization_config, the `--quantization-config` online args) and answers `get_quant_method(layer, prefix)` for every
module it builds: the weight format and activation scheme it serves must be the plan's for every tensor it loads.
Where policyc refuses, the cases below show vLLM would indeed serve something else."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

from oracles import vllm_oracle
from precision_dsl.arch import load_architecture
from precision_dsl.backends import vllm
from precision_dsl.backends.common import Problems, module_of
from precision_dsl.parallel import parse_parallel
from precision_dsl.precision import FormatKind
from precision_dsl.resolve import resolve

from conftest import DENSE_RECIPES

REPO = Path(__file__).resolve().parents[1]
POLICIES = sorted(p.stem for p in (REPO / "policies").glob("*.policy") if p.stem not in DENSE_RECIPES)
MODELS = ["tiny-moe", "qwen3-30b-a3b", "deepseek-v3", "glm-4.5-air"]
LAYOUTS = {"none": None, "tp4ep4": "rollout:tp=4,ep=4"}
VERSION = vllm.VLLM_VERSION
assert VERSION in vllm_oracle.VLLM_VERSIONS


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=4)
def plan_of(policy, model, layout):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), parse_parallel(LAYOUTS[layout]))


def model_dir_for(plan, root: Path) -> Path:
    """The model directory `policyc convert` writes for `plan`, without weights (vLLM resolves its config and quant
    methods from config.json / hf_quant_config.json alone)."""
    import precision_dsl
    from precision_dsl.backends.converter import quantization_files

    config = json.loads((Path(precision_dsl.__file__).parent / "models" / plan.model / "config.json").read_text())
    q = quantization_files(plan)
    if q["quantization_config"] is not None:
        config["quantization_config"] = q["quantization_config"]
    else:
        config.pop("quantization_config", None)
    d = Path(tempfile.mkdtemp(prefix=f"{plan.model}-", dir=root))
    (d / "config.json").write_text(json.dumps(config))
    if q["hf_quant_config"] is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(q["hf_quant_config"]))
    return d


def emitted(plan):
    problems = Problems()
    arts = vllm.VllmBackend().emit(plan, None, problems)
    return {a.path: a.data() for a in arts}, problems.folded()


def expected_activation(t) -> str:
    """The oracle's activation-scheme words for the plan's activation format."""
    if not (t.is_linear and t.weight.is_quantized):
        return "bf16"
    a = t.precision.activation
    if a.kind == FormatKind.NVFP4:
        return "nvfp4 per-token" if a.global_scale == "row" else "nvfp4 static per-tensor"
    if a.kind == FormatKind.FP8_BLOCK:
        return f"fp8 {a.block[0]}x{a.block[1]} dynamic"
    if a.kind == FormatKind.MXFP8:
        return "mxfp8 dynamic"
    return a.short()


def _shard_key(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def module_of_tensor(modules: dict, plan) -> dict[str, tuple[str, object]]:
    """HF tensor name -> (vLLM prefix, ModuleQuant) through the modules' shards (HF module or tensor names)."""
    by_shard = {}
    for prefix, mq in modules.items():
        for s in mq.shards:
            by_shard[_shard_key(s)] = (prefix, mq)
    out = {}
    for t in plan.tensors:
        mod = module_of(t.hf_name)
        hit = by_shard.get(mod) or by_shard.get(t.hf_name)
        if hit is None and t.role.startswith("routed_experts."):
            hit = by_shard.get(mod.rsplit(".", 2)[0])  # shards may name the RoutedExperts container
        if hit is not None:
            out[t.hf_name] = hit
    return out


def disagreements(plan, modules) -> list[str]:
    served = {t.hf_name for t in plan.tensors if t.mtp is None and (t.is_linear or t.role == "router.weight")}
    where = module_of_tensor(modules, plan)
    out = [f"{n}: vLLM builds no module for it" for n in sorted(served - set(where))]
    by = plan.by_name()
    for n in sorted(served & set(where)):
        t, (prefix, mq) = by[n], where[n]
        want = t.weight.short() if t.is_linear and t.weight.is_quantized else "bf16"
        if mq.weight != want:
            out.append(f"{n} ({prefix}, {mq.method}): plan weight {want}, vLLM serves {mq.weight}")
        if mq.activation != expected_activation(t):
            out.append(f"{n} ({prefix}, {mq.method}): plan activation {expected_activation(t)}, vLLM runs "
                       f"{mq.activation}")
    return out


def ask(plan, args, tmp_path):
    d = model_dir_for(plan, tmp_path)
    vllm_oracle.parse_engine_args(VERSION, ["--model", str(d), *args])  # vLLM's parser + engine config accept them
    return vllm_oracle.vllm_modules(VERSION, d, args)


CASES = [(p, m, lay) for p in POLICIES for m in MODELS for lay in LAYOUTS
         if not (m == "deepseek-v3" and lay != "none")]


@pytest.mark.parametrize("policy,model,layout", CASES)
def test_vllm_serves_exactly_the_plan(policy, model, layout, tmp_path):
    plan = plan_of(policy, model, layout)
    arts, problems = emitted(plan)
    if problems:
        assert not arts and all(p.backend == "vllm" and p.capability for p in problems)
        return
    args = json.loads(arts[vllm.MANIFEST])["engine_args"]
    modules = ask(plan, args, tmp_path)
    assert modules, "the oracle answered no module"
    bad = disagreements(plan, modules)
    assert not bad, f"{len(bad)} disagreements, e.g. " + "; ".join(bad[:5])


def _override(args, qcfg) -> list[str]:
    args = list(args)
    args[args.index("--hf-overrides") + 1] = json.dumps({"quantization_config": qcfg})
    return args


def test_vllm_quantizes_the_qwen3_router_unless_excluded(tmp_path):
    """Why the router is listed: Qwen3-MoE's mlp.gate is a GateLinear built with the quant config."""
    plan = plan_of("fp8-blockwise-hopper", "qwen3-30b-a3b", "none")
    arts, problems = emitted(plan)
    assert not problems
    m = json.loads(arts[vllm.MANIFEST])
    qcfg = dict(m["quantization_config"])
    qcfg["ignored_layers"] = [e for e in qcfg["ignored_layers"] if not e.endswith(".mlp.gate")]
    modules = ask(plan, _override(m["engine_args"], qcfg), tmp_path)
    assert modules["model.layers.0.mlp.gate"].weight != "bf16"
    assert any("mlp.gate.weight" in d for d in disagreements(plan, modules))


def test_vllm_reads_no_modules_to_not_convert_for_mxfp8(tmp_path):
    """Why the converter's MXFP8 config is not handed to vLLM as it is: quant_method mxfp8 (ModelOptMxFp8Config)
    reads only ignored_layers, so every exclusion in modules_to_not_convert is lost."""
    plan = plan_of("mxfp8-e2e", "tiny-moe", "none")
    from precision_dsl.backends.converter import quantization_files

    qcfg = quantization_files(plan)["quantization_config"]
    assert qcfg["quant_method"] == "mxfp8" and qcfg["modules_to_not_convert"]
    d = model_dir_for(plan, tmp_path)
    modules = vllm_oracle.vllm_modules(VERSION, d, ["--kv-cache-dtype", "bfloat16"])
    excluded = qcfg["modules_to_not_convert"][0]  # an HF module name, e.g. model.layers.3.self_attn.q_proj
    hit = module_of_tensor(modules, plan).get(excluded + ".weight")
    assert hit is not None and hit[1].weight != "bf16"


def test_vllm_nvfp4_experts_without_the_override_use_a_static_scale(tmp_path):
    """Why the per-token override is emitted: without it ModelOpt NVFP4 routed experts take a static global
    activation scale."""
    plan = plan_of("miles-nvfp4", "tiny-moe", "none")
    arts, problems = emitted(plan)
    assert not problems
    args = json.loads(arts[vllm.MANIFEST])["engine_args"]
    i = args.index("--quantization-config")
    modules = ask(plan, args[:i] + args[i + 2:], tmp_path)
    assert modules["model.layers.0.mlp.experts"].activation != "nvfp4 per-token"
