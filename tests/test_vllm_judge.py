"""vLLM's own code judges what policyc emits for it (tests/oracles/vllm_oracle.py).

For every shipped policy x {tiny-moe, qwen3-30b-a3b, deepseek-v3, glm-4.5-air} x rollout layouts the gate accepts, and
for each judged vLLM release (0.33.0 and verl 0.9.1's 0.24.0): the vLLM backend emits for that release, or refuses by
name. Where it emits, vLLM - given the model directory `policyc convert --rollout vllm` writes (config.json with the
converter's quantization_config) and exactly the emitted engine args - parses the args with its real parser, builds
the quant config its loader builds and answers `get_quant_method(layer, prefix)` for every module it builds: the
weight format and activation scheme it serves must be the plan's for every tensor it loads, and every quantized layer
must register exactly the tensors the converter writes for it. The declared version range must name exactly the
judged releases that serve the plan with the same configuration.

CI cost: the big models are judged on reduced-layer variants (their dense / MoE / MTP structure kept: the rules are
per layer), and vLLM's answer is cached per (release, config.json, engine args) within the session - most policies
share a configuration (the three MXFP8 policies differ only in backward)."""

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
from precision_dsl.backends.registry import EmitOptions
from precision_dsl.parallel import parse_parallel
from precision_dsl.precision import FormatKind
from precision_dsl.resolve import resolve

from conftest import DENSE_RECIPES

REPO = Path(__file__).resolve().parents[1]
POLICIES = sorted(p.stem for p in (REPO / "policies").glob("*.policy") if p.stem not in DENSE_RECIPES)
# model -> the config overrides of its reduced variant (None: the bundled config as it is)
MODELS = {"tiny-moe": None,
          "qwen3-30b-a3b": {"num_hidden_layers": 8},
          "deepseek-v3": {"num_hidden_layers": 6},  # 3 dense + 3 MoE layers + the MTP layer
          "glm-4.5-air": {"num_hidden_layers": 6}}  # 1 dense + 5 MoE layers + the MTP layer
# (an EP wider than TP, vLLM's TP x DP expert parallelism, is refused by the gate's static checks: SGLang's
# tp_size % ep_size == 0; the backend's own arguments for it are in tests/test_backend_vllm.py)
LAYOUTS = {"none": None, "tp2ep2": "rollout:tp=2,ep=2", "tp4ep4": "rollout:tp=4,ep=4"}
# the layouts judged per model (each accepted by the gate's static checks, asserted below)
MODEL_LAYOUTS = {"tiny-moe": ["none", "tp2ep2"], "qwen3-30b-a3b": ["none", "tp2ep2", "tp4ep4"],
                 "deepseek-v3": ["none", "tp4ep4"], "glm-4.5-air": ["none", "tp2ep2", "tp4ep4"]}
VERSIONS = vllm.VLLM_JUDGED
assert set(VERSIONS) <= set(vllm_oracle.VLLM_VERSIONS)

# Cells the backend refuses, and the words the refusal must carry (version, policy, model, layout; None = any).
MXFP8_024 = "MXFP8 on vLLM 0.24.0"
NVFP4_024 = "NVFP4 per-token activations on vLLM 0.24.0"
REFUSED = [
    (None, "language-tour", None, None, "'pow2' FP8-block scales"),
    (None, "nvfp4-weight-only", None, None, "weight-only NVFP4"),
    # a shard boundary inside a 128-row block of the fused weight: tiny-moe k_proj N = 64 in qkv_proj, GLM-4.5-Air
    # dense gate_proj N = 10944 in gate_up_proj
    (None, "fp8-blockwise-hopper", "tiny-moe", None, "scale grid then straddles two shards"),
    (None, "fp8-blockwise-hopper", "glm-4.5-air", None, "scale grid then straddles two shards"),
    ("0.24.0", "*", "deepseek-v3", None, "MLA attention on vLLM 0.24.0: not judged"),
    ("0.24.0", "mxfp8-*", None, None, MXFP8_024),
    ("0.24.0", "nvfp4-pertoken-*", None, None, NVFP4_024),
    ("0.24.0", "miles-nvfp4", None, None, NVFP4_024),
    # tiny-moe's o_proj K per rank 64 < 128 at tp=2: no FlashInfer MXFP8 GEMM
    ("0.33.0", "mxfp8-*", "tiny-moe", "tp2ep2", "the FlashInfer MXFP8 GEMMs need N >= 128 and K >= 128"),
    # GLM-4.5-Air's dense down_proj K = 10944 is 2736 per rank at tp=4: not a whole number of 32-blocks
    ("0.33.0", "mxfp8-*", "glm-4.5-air", "tp4ep4", "mxfp8 needs K per rank % 32 == 0"),
]


def expected_refusal(version, policy, model, layout):
    import fnmatch

    for v, p, m, lay, words in REFUSED:
        if (v in (None, version) and fnmatch.fnmatchcase(policy, p) and m in (None, model)
                and lay in (None, layout)):
            return words
    return None


_ROOT = Path(tempfile.mkdtemp(prefix="policyc-vllm-judge-"))


@functools.lru_cache(maxsize=None)
def config_of(model: str) -> dict:
    config = json.loads((REPO / "precision_dsl" / "models" / model / "config.json").read_text())
    config.update(MODELS.get(model) or {})  # a model outside the judged grid: its bundled config as it is
    return config


@functools.lru_cache(maxsize=None)
def arch_of(model: str):
    if MODELS[model] is None:
        return load_architecture(model)
    d = _ROOT / "arch" / model
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config_of(model)))
    return load_architecture(str(d))


@functools.lru_cache(maxsize=8)
def plan_of(policy: str, model: str, layout: str):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), parse_parallel(LAYOUTS[layout]))


def model_dir_for(plan, model: str) -> Path:
    """The model directory `policyc convert --rollout vllm` writes for `plan`, without weights (vLLM resolves its
    config and quant methods from config.json alone): the cached directory of that config."""
    from precision_dsl.backends.converter import quantization_files

    config = dict(config_of(model))
    q = quantization_files(plan, "vllm")
    assert q["hf_quant_config"] is None  # vLLM reads config.json's quantization_config only
    if q["quantization_config"] is not None:
        config["quantization_config"] = q["quantization_config"]
    else:
        config.pop("quantization_config", None)
    return _dir_of(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _dir_of(config_json: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="model-", dir=_ROOT))
    (d / "config.json").write_text(config_json)
    return d


def emitted(plan, version):
    problems = Problems()
    arts = vllm.VllmBackend().emit(plan, EmitOptions(rollout="vllm", vllm_version=version), problems)
    return {a.path: a.data() for a in arts}, problems.folded()


@functools.lru_cache(maxsize=None)
def modules_of(version: str, model_dir: Path, args: tuple, target: str):
    """vLLM's answer, once per (release, config, engine args, target) in the session."""
    # vLLM's real serve parser and engine config accept exactly the emitted args
    vllm_oracle.parse_engine_args(version, ["--model", str(model_dir), "--skip-tokenizer-init", *args], target)
    return vllm_oracle.vllm_modules(version, model_dir, list(args), target)


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


def module_of_tensor(modules: dict, plan) -> dict[str, tuple[str, object]]:
    """HF tensor name -> (vLLM prefix, ModuleQuant) through the modules' shards (HF module names)."""
    by_shard = {}
    for prefix, mq in modules.items():
        for s in mq.shards:
            by_shard[s] = (prefix, mq)
    return {t.hf_name: by_shard[module_of(t.hf_name)] for t in plan.tensors if module_of(t.hf_name) in by_shard}


def served(plan) -> set[str]:
    return {t.hf_name for t in plan.tensors if t.mtp is None and (t.is_linear or t.role == "router.weight")}


def disagreements(plan, modules) -> list[str]:
    where = module_of_tensor(modules, plan)
    want_served = served(plan)
    out = [f"{n}: vLLM builds no module for it" for n in sorted(want_served - set(where))]
    # vLLM builds no GEMM module for what the plan does not serve (MTP without --speculative-config)
    out += [f"{n}: vLLM builds {where[n][0]}, the backend says it is not served" for n in sorted(set(where))
            if n not in want_served and plan.by_name()[n].is_linear]
    by = plan.by_name()
    for n in sorted(want_served & set(where)):
        t, (prefix, mq) = by[n], where[n]
        want = t.weight.short() if t.is_linear and t.weight.is_quantized else "bf16"
        got = mq.formats.get(module_of(n), mq.weight)
        if got != want:
            out.append(f"{n} ({prefix}, {mq.method}): plan weight {want}, vLLM serves {got}")
        if mq.activation != expected_activation(t):
            out.append(f"{n} ({prefix}, {mq.method}): plan activation {expected_activation(t)}, vLLM runs "
                       f"{mq.activation}")
    return out


def _expert_param(shard: str, suffix: str) -> str:
    """vLLM's RoutedExperts parameter of an HF expert tensor (fused_moe/routed_experts.py
    build_expert_params_mapping: experts.E.{gate,up}_proj.S -> w13_S, down_proj.S -> w2_S)."""
    return f"{'w2' if shard.endswith('down_proj') else 'w13'}_{suffix}"


def name_disagreements(plan, modules) -> list[str]:
    """Every quantized vLLM layer registers exactly the tensors `policyc convert --rollout vllm` writes for it."""
    from precision_dsl.backends.quantize import rollout_tensor_names

    where = module_of_tensor(modules, plan)
    want: dict[str, set[str]] = {}
    for t in plan.tensors:
        if t.hf_name not in where or not (t.is_linear and t.weight.is_quantized):
            continue
        prefix, mq = where[t.hf_name]
        mod = module_of(t.hf_name)
        for name in rollout_tensor_names(t, "vllm"):
            suffix = name[len(mod) + 1:]
            want.setdefault(prefix, set()).add(_expert_param(mod, suffix) if mq.layer == "RoutedExperts" else suffix)
    out = []
    for prefix, names in sorted(want.items()):
        # the GEMM's tensors (a MoE layer also holds the router's e_score_correction_bias, loaded as it is)
        have = {n for n in modules[prefix].params if "weight" in n or "scale" in n}
        if not have and modules[prefix].kernel_error:
            continue  # its create_weights chose the missing CPU kernel before registering anything (the oracle's doc)
        if have != names:
            out.append(f"{prefix}: vLLM registers {sorted(have)}, the converter writes {sorted(names)}")
    return out


CASES = [(v, p, m, lay) for v in VERSIONS for p in POLICIES for m in MODELS for lay in MODEL_LAYOUTS[m]]


@pytest.mark.parametrize("version,policy,model,layout", CASES)
def test_vllm_serves_exactly_the_plan(version, policy, model, layout):
    plan = plan_of(policy, model, layout)
    arts, problems = emitted(plan, version)
    reason = expected_refusal(version, policy, model, layout)
    if reason is not None:
        assert not arts and problems, f"expected a refusal naming {reason!r}"
        assert any(reason in p.capability for p in problems), [str(p) for p in problems]
        assert all(p.backend == "vllm" and p.hint for p in problems)
        return
    assert not problems, [str(p) for p in problems]
    m = json.loads(arts[vllm.MANIFEST])
    args = tuple(m["engine_args"])
    assert arts["vllm/launch_args.txt"].decode().split("\n")[0] == __import__("shlex").join(args)
    d = model_dir_for(plan, model)
    # the converter's config.json and --hf-overrides hold the same quantization_config
    assert json.loads((d / "config.json").read_text()).get("quantization_config") == m["quantization_config"]
    modules = modules_of(version, d, args, plan.target)
    assert modules, "the oracle answered no module"
    bad = disagreements(plan, modules) + name_disagreements(plan, modules)
    assert not bad, f"{len(bad)} disagreements, e.g. " + "; ".join(bad[:5])
    # the declared range: exactly the judged releases that emit this very configuration
    same = []
    for v in VERSIONS:
        other, probs = emitted(plan, v)
        if not probs and json.loads(other[vllm.MANIFEST])["engine_args"] == list(args):
            same.append(v)
    want = f"vllm>={same[0]},<={same[-1]}" if len(same) > 1 else f"vllm=={same[0]}"
    assert m["requires"] == want and want in arts["vllm/env.sh"].decode().splitlines()[0]


@pytest.mark.parametrize("model", list(MODELS))
def test_judged_layouts_pass_the_gate(model):
    from precision_dsl.checks import check

    for layout in MODEL_LAYOUTS[model]:
        plan = plan_of("bf16", model, layout)
        errors = [d for d in check(plan, arch_of(model), plan.parallel) if d.severity == "error"]
        assert not errors, (layout, [d.message for d in errors])


def _override(args, qcfg) -> list[str]:
    args = list(args)
    args[args.index("--hf-overrides") + 1] = json.dumps({"quantization_config": qcfg})
    return args


def _args(plan, version=vllm.VLLM_VERSION):
    arts, problems = emitted(plan, version)
    assert not problems, [str(p) for p in problems]
    return json.loads(arts[vllm.MANIFEST])


def test_vllm_quantizes_the_qwen3_router_unless_excluded():
    """Why the router is listed: Qwen3-MoE's mlp.gate is a GateLinear built with the quant config."""
    plan = plan_of("fp8-blockwise-hopper", "qwen3-30b-a3b", "none")
    m = _args(plan)
    qcfg = dict(m["quantization_config"])
    qcfg["ignored_layers"] = [e for e in qcfg["ignored_layers"] if not e.endswith(".mlp.gate")]
    d = _dir_of(json.dumps({**config_of("qwen3-30b-a3b"), "quantization_config": qcfg}, sort_keys=True))
    modules = modules_of(vllm.VLLM_VERSION, d, tuple(_override(m["engine_args"], qcfg)), "hopper")
    assert modules["model.layers.0.mlp.gate"].weight != "bf16"
    assert any("mlp.gate.weight" in x for x in disagreements(plan, modules))


def test_vllm_reads_no_modules_to_not_convert_for_mxfp8():
    """Why the SGLang checkpoint config is not the vLLM one: quant_method mxfp8 (ModelOptMxFp8Config) reads only
    ignored_layers, so every exclusion in SGLang's modules_to_not_convert is lost."""
    from precision_dsl.backends.converter import quantization_files

    plan = plan_of("mxfp8-e2e", "tiny-moe", "none")
    qcfg = quantization_files(plan)["quantization_config"]
    assert qcfg["quant_method"] == "mxfp8" and qcfg["modules_to_not_convert"]
    d = _dir_of(json.dumps({**config_of("tiny-moe"), "quantization_config": qcfg}, sort_keys=True))
    modules = modules_of(vllm.VLLM_VERSION, d, ("--kv-cache-dtype", "bfloat16"), "blackwell")
    excluded = qcfg["modules_to_not_convert"][0]  # an HF module name, e.g. model.layers.3.self_attn.q_proj
    hit = module_of_tensor(modules, plan).get(excluded + ".weight")
    assert hit is not None and hit[1].weight != "bf16"


def test_vllm_mxfp8_loads_weight_scale_not_sglangs_weight_scale_inv():
    """Why the vLLM checkpoint renames the E8M0 scales: vLLM's ModelOpt MXFP8 layers register `weight_scale`."""
    from precision_dsl.backends.quantize import rollout_tensor_names

    plan = plan_of("mxfp8-e2e", "qwen3-30b-a3b", "none")
    args = _args(plan)["engine_args"]
    i = args.index("--moe-backend")  # unpinned: a kernel-less CPU then still registers the MoE parameters
    modules = modules_of(vllm.VLLM_VERSION, model_dir_for(plan, "qwen3-30b-a3b"), tuple(args[:i] + args[i + 2:]),
                         "blackwell")
    qkv = modules["model.layers.0.self_attn.qkv_proj"]
    assert qkv.method == "ModelOptLinearMethod" and qkv.params == ["weight", "weight_scale"]
    assert "w13_weight_scale" in modules["model.layers.0.mlp.experts"].params
    q = plan.by_name()["model.layers.0.self_attn.q_proj.weight"]
    assert rollout_tensor_names(q, "sglang")[1].endswith(".weight_scale_inv")
    assert rollout_tensor_names(q, "vllm")[1].endswith(".weight_scale")


def test_vllm_nvfp4_experts_without_the_override_use_a_static_scale():
    """Why the per-token override is emitted: without it ModelOpt NVFP4 routed experts take a static global
    activation scale."""
    plan = plan_of("miles-nvfp4", "tiny-moe", "none")
    args = _args(plan)["engine_args"]
    i = args.index("--quantization-config")
    modules = modules_of(vllm.VLLM_VERSION, model_dir_for(plan, "tiny-moe"), tuple(args[:i] + args[i + 2:]),
                         "blackwell")
    assert modules["model.layers.0.mlp.experts"].activation != "nvfp4 per-token"


def test_vllm_0_24_has_no_per_token_nvfp4_experts():
    """Why NVFP4 per-token is refused for 0.24.0: its parser rejects the activation override, and without it its
    ModelOpt NVFP4 MoE takes a static global activation scale."""
    plan = plan_of("miles-nvfp4", "tiny-moe", "none")
    args = _args(plan)["engine_args"]
    d = model_dir_for(plan, "tiny-moe")
    with pytest.raises(vllm_oracle.VllmRefused):
        modules_of("0.24.0", d, tuple(args), "blackwell")
    i = args.index("--quantization-config")
    experts = modules_of("0.24.0", d, tuple(args[:i] + args[i + 2:]), "blackwell")["model.layers.0.mlp.experts"]
    assert experts.method == "ModelOptNvFp4FusedMoE" and experts.activation == "nvfp4 static per-expert"


def test_vllm_0_24_refuses_the_modelopt_mxfp8_checkpoint():
    plan = plan_of("mxfp8-e2e", "qwen3-30b-a3b", "none")
    args = _args(plan)["engine_args"]
    with pytest.raises(vllm_oracle.VllmRefused, match="mxfp8 is an override"):
        modules_of("0.24.0", model_dir_for(plan, "qwen3-30b-a3b"), tuple(args), "blackwell")
