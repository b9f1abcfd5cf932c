"""`policyc run --engine verl`: the plan as a verl 0.9.1 launch (`python -m verl.trainer.main_ppo --config-name
ppo_megatron_trainer` + Hydra overrides), or a refusal naming every tensor / setting verl's own paths cannot carry.

What verl reads, and where each plan value goes (verl 0.9.1 wheel):

  trainer  Megatron actor: actor_rollout_ref.actor.megatron.{tensor,pipeline,expert,expert_tensor}_model_parallel_size
           and `override_transformer_config`, a free-form dict verl sets field by field on the Megatron-Bridge
           provider (verl/workers/engine/megatron/transformer_impl.py: provider_overrides) = TransformerConfig fields.
           The megatron backend's flags map onto those fields by megatron-core's own names (fp8, fp8_recipe, fp4,
           fp4_recipe, first_last_layers_bf16, num_layers_at_start/end_in_bf16, moe_router_dtype, fp8_param,
           num_layers_in_first/last_pipeline_stage, moe_grouped_gemm, transformer_impl). The per-module TE precision
           YAML (the file a Miles launch passes as --te-precision-config-file) goes in as
           override_transformer_config.quant_recipe = its absolute path, a str: megatron-core reads the field only as
           a RecipeConfig object (transformer_config.py:877), which Hydra data cannot be, so the launch also sets
           actor_rollout_ref.model.external_lib = policyc's verl plugin (engine/verl_plugin.py). verl imports that
           module in every worker before it builds the model (verl/workers/config/model.py:149, HFModelConfig
           __post_init__ -> import_external_libs; the key verl's config documents, trainer/config/model/
           hf_model.yaml `external_lib`), and the plugin makes TransformerConfig.__post_init__ load the path with
           RecipeConfig.from_yaml_file. A reference model (none in this recipe) would read the same dict: verl's
           ref.megatron.override_transformer_config interpolates the actor's (trainer/config/ref/megatron_ref.yaml).
           A YAML that changes nothing against the global flags is left out (the launch stays plugin-free).
  env      the TE variables (megatron backend) and the rollout's (rollout backend) reach every Ray worker through
           ray_kwargs.ray_init.runtime_env.env_vars (verl/trainer/main_ppo.py run_ppo merges it into ray.init), as
           strings; the unset ones are unset in the driver shell, which starts the local Ray cluster.
  rollout  actor_rollout_ref.rollout.{name, tensor_model_parallel_size, data_parallel_size, expert_parallel_size}
           (verl builds tensor_parallel_size / enable_expert_parallel / ep_size from them) and
           engine_kwargs.<engine>.* for the rest of the rollout backend's args. engine_kwargs are spread LAST into
           the engine args (vllm_rollout/vllm_async_server.py, sglang_rollout/async_sglang_server.py), so a key verl
           sets itself (quantization, hf_overrides, json_model_override_args, tensor_parallel_size, ...) is never
           put there: it would silently replace verl's own value.
  weights  load_format=dummy: the rollout gets every weight from the actor through verl's weight sync; no converted
           checkpoint is read. The sync sends the actor's BF16 parameters; for an FP8 vLLM rollout verl quantizes
           every param vLLM built as FP8 and passes the rest as BF16 (verl/utils/vllm/vllm_quant_utils.py
           quant_weights / is_fp8_weight), so the plan is carried exactly when vLLM's reading of the config verl
           injects for rollout.quantization=fp8 (block 128x128, ignored_layers = every `model.layers.{i}.mlp.gate`)
           gives every served weight the plan's format (the vllm backend's derive_formats on that config); any other
           plan is refused naming the first tensor it would change (an engine_kwargs.vllm.hf_overrides would
           replace verl's config behind its sync's back). verl's quantizer (verl/utils/kernel/fp8_kernel.py
           scaled_fp8_blockwise) runs a Triton kernel wherever Triton imports: scale_inv = max(amax, 1e-10) / 448,
           q = x * (1 / scale_inv), other bytes than the plan's TransformerEngine FP8-block format; its PyTorch path
           (VERL_DISABLE_TRITON_FP8=1, set in the env) computes TE's scale = 448 / amax, scale_inv = 1 / scale,
           q = x * scale, so it is the one used. rollout.quantization accepts fp8 / torchao / ascend only
           (_apply_quantization), SGLang fp8 only. Any other quantized vLLM rollout (NVFP4, MXFP8, FP8 blocks verl's
           config would not serve) is supplied the way verl is meant to be extended: policyc's worker extension
           (engine/verl_worker.py) as engine_kwargs.vllm.worker_extension_cls, which verl's own sync RPC
           (update_weights_from_ipc) reaches; it quantizes the BF16 weights verl sends with the converter's function
           and loads them through vLLM's layerwise reload. The server is started on the vllm backend's own args
           (quantization, hf_overrides = the plan's quantization_config, quantization_config, ...) as engine_kwargs:
           with rollout.quantization=null verl's own values of those keys are None / {} (_apply_quantization), so
           spreading ours over them replaces nothing verl relies on. The plan reaches the worker as the emitted
           policyc_plan.json (POLICYC_VERL_PLAN + its hash, in the Ray runtime env). An FP8 SGLang rollout is
           refused by name: its sender matches SGLANG_FP8_IGNORED_LAYERS with its own rules
           (verl/utils/sglang/sglang_fp8_utils.py), and SGLang has no worker extension hook in verl.
           nvfp4-weight-only: verl's Megatron NVFP4 W4A16 QAT (megatron.qat, ModelOpt fake quantization exported
           by verl/utils/modelopt/qat_weight_exporter.py) is a different quantizer than the plan's and serves
           through vLLM's Marlin W4A16 path, which the vllm backend already refuses by name; it is not used.

Everything policyc does not decide is a placeholder the launcher sets ($HF_CKPT, $TRAIN_FILES, $VAL_FILES, $NNODES,
$GPUS_PER_NODE); every path in the script is absolute. The gate of `policyc check` (megatron + the rollout backend)
runs first.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..arch import load_architecture
from ..backends import megatron, versions
from ..backends.common import PLAN_FILE, Problems, UnsupportedByBackend, is_quantized
from ..backends.registry import EmitOptions
from ..errors import PolicycError
from ..parallel import parse_parallel
from .gate import refusal_diagnostics, run_gate
from .plans import load_plan, policy_path

BACKEND = "verl"
VERL_VERSION = "0.9.1"
ROLLOUTS = ("vllm", "sglang")
CONFIG_NAME = "ppo_megatron_trainer"
SCRIPT = "launch_verl.sh"
OVERRIDES = "verl_overrides.txt"
# Placeholders of the launch (shell variables set by whoever runs it) and the value the oracle substitutes.
PLACEHOLDERS = {"HF_CKPT": "the BF16 HF checkpoint directory", "TRAIN_FILES": "the training parquet file(s)",
                "VAL_FILES": "the validation parquet file(s) (default: TRAIN_FILES)",
                "NNODES": "nodes (default 1)", "GPUS_PER_NODE": "GPUs per node (default: default_gpus)"}

_MEGATRON = "actor_rollout_ref.actor.megatron"
_ROLLOUT = "actor_rollout_ref.rollout"
_MODEL = "actor_rollout_ref.model"
# the verl plugin (engine/verl_plugin.py; named, not imported: importing it patches megatron-core) and the
# TransformerConfig field it loads
PLUGIN = "precision_dsl.engine.verl_plugin"
RECIPE_KEY = "quant_recipe"
_ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
# megatron backend flag -> McoreEngineConfig key (verl/trainer/config/engine/megatron.yaml)
PARALLEL_KEYS = {"--tensor-model-parallel-size": "tensor_model_parallel_size",
                 "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
                 "--expert-model-parallel-size": "expert_model_parallel_size",
                 "--expert-tensor-parallel-size": "expert_tensor_parallel_size"}
# megatron backend flag -> TransformerConfig field (Megatron-LM core_v0.16.1 arguments.py names them)
TC_VALUES = {"--fp8-format": "fp8", "--fp8-recipe": "fp8_recipe", "--fp4-format": "fp4", "--fp4-recipe": "fp4_recipe",
             "--num-layers-at-start-in-bf16": "num_layers_at_start_in_bf16",
             "--num-layers-at-end-in-bf16": "num_layers_at_end_in_bf16",
             "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
             "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
             "--moe-router-dtype": "moe_router_dtype", "--transformer-impl": "transformer_impl"}
TC_BOOLS = {"--first-last-layers-bf16": "first_last_layers_bf16", "--fp8-param-gather": "fp8_param",
            "--fp4-param-gather": "fp4_param", "--moe-grouped-gemm": "moe_grouped_gemm"}
# --bf16: verl's megatron.dtype=bfloat16 (the provider's params_dtype / bf16, transformer_impl.py)
# rollout backend arg -> verl rollout config key; any other arg goes to engine_kwargs.<engine> unless verl sets it
ROLLOUT_KEYS = {"vllm": {"--tensor-parallel-size": "tensor_model_parallel_size",
                         "--pipeline-parallel-size": "pipeline_model_parallel_size",
                         "--data-parallel-size": "data_parallel_size"},
                "sglang": {"--tp-size": "tensor_model_parallel_size", "--ep-size": "expert_parallel_size",
                           "--dp-size": "data_parallel_size"}}
# engine args verl itself passes (vllm_async_server.py `args`, async_sglang_server.py `args`): never engine_kwargs
VERL_SETS = {"vllm": {"quantization", "hf_overrides", "tensor_parallel_size", "data_parallel_size", "dtype",
                      "load_format", "worker_extension_cls", "enable_expert_parallel", "enable_sleep_mode", "seed"},
             "sglang": {"quantization", "json_model_override_args", "tp_size", "dp_size", "ep_size", "dtype",
                        "load_format", "model_path", "custom_weight_loader"}}
# the keys the vllm backend's args hold that verl also passes: with rollout.quantization=null verl's values are
# quantization=None and hf_overrides={} (vllm_async_server.py _apply_quantization), so the extension launch sets them
EXTENSION_SETS = {"quantization", "hf_overrides"}
# GRPO settings of the recipe (the Miles launch's RL_FLAGS): 8 samples per prompt, no KL term (so no reference model)
RL_OVERRIDES = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
                "actor_rollout_ref.actor.use_kl_loss=False", f"{_ROLLOUT}.n=8",
                "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.actor.optim.weight_decay=0.0"]


class VerlError(PolicycError, RuntimeError):
    def __init__(self, message: str, hint: str = "", code: int = 2):
        super().__init__(message)
        self.hint, self.code = hint, code


@dataclass
class VerlLaunch:
    overrides: list[str]  # Hydra overrides; "$NAME" placeholders are expanded by the shell
    env: dict[str, str]  # also in the Ray runtime env
    unset_env: list[str]
    gpus_per_node: int = 8  # the script's default: the smallest GPU count the layouts fit
    notes: list[str] = field(default_factory=list)


def default_gpus(plan) -> int:
    """The smallest world both layouts tile (Megatron: tp x pp and pp x ep x etp divide it; the rollout: tp x dp
    replicas), or 8 when 8 is a multiple of it (one common node)."""
    from math import lcm

    t = plan.parallel.trainer if plan.parallel else None
    r = plan.parallel.rollout if plan.parallel else None
    sizes = [1]
    if t is not None:
        sizes += [t.tp * t.pp, t.pp * t.ep * t.etp]
    if r is not None:
        sizes += [max(r.tp, r.ep)]  # vLLM: EP = TP x DP ranks per replica
    n = lcm(*sizes)
    return 8 if 8 % n == 0 else n


def _hydra_str(value: str) -> str:
    """A Hydra override value that stays a string (Ray wants env values as str; a bare 1 would be an int)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _hydra_value(value: str) -> str:
    """An engine arg as a Hydra override value: JSON (hf_overrides, quantization_config) stays one string, as vLLM
    parses it from its command line (verl's build_cli_args_from_config passes a str through as is)."""
    if value and value[0] in "{[" or any(c in value for c in " ,'\"=:"):
        if "'" in value or "\\" in value or "${" in value:  # pragma: no cover - the backends write plain JSON
            raise VerlError(f"engine arg {value[:60]!r} cannot be written as one Hydra string")
        return "'" + value + "'"
    return value


def _pairs(argv: list[str]) -> list[tuple[str, Optional[str]]]:
    """('--flag', value or None for a switch) of an argv fragment."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((a, argv[i + 1]))
            i += 2
        else:
            out.append((a, None))
            i += 1
    return out


def _yaml_changes_nothing(plan, cfg) -> bool:
    """Whether the global flags alone (no --te-precision-config-file) already give every module its recipe."""
    pp = plan.parallel.trainer.pp if plan.parallel else 1
    flags = [f for i, f in enumerate(cfg.flags) if f != "--te-precision-config-file"
             and (i == 0 or cfg.flags[i - 1] != "--te-precision-config-file")]
    got = megatron.resolve_modules(flags, {}, list(cfg.module_recipes), plan.num_layers, pp, use_megatron=False)
    return all(got[m] == megatron.RECIPE_KIND.get(r.name, "bf16") for m, r in cfg.module_recipes.items())


def trainer_overrides(plan, te_version: Optional[str], problems: Problems,
                      megatron_dir: str = "megatron") -> tuple[list[str], dict[str, str]]:
    """The Megatron actor's overrides and TE env, refusals into `problems`. `megatron_dir`: where the megatron
    backend's files are (absolute in an emitted launch); a per-module recipe is named there by path."""
    try:
        cfg = megatron.trainer_config(plan, te_version)
    except UnsupportedByBackend as err:
        problems.add(err)
        return [], {}
    out: list[str] = []
    if cfg.yamls and not _yaml_changes_nothing(plan, cfg):
        (name,) = cfg.yamls
        # a plain str in verl's config; the plugin verl imports through external_lib loads it as a RecipeConfig
        out.append(f"++{_MEGATRON}.override_transformer_config.{RECIPE_KEY}={_hydra_str(f'{megatron_dir}/{name}')}")
        out.append(f"{_MODEL}.external_lib={PLUGIN}")
    for flag, value in _pairs(cfg.flags):
        if flag in PARALLEL_KEYS:
            out.append(f"{_MEGATRON}.{PARALLEL_KEYS[flag]}={value}")
        elif flag in TC_VALUES:
            out.append(f"++{_MEGATRON}.override_transformer_config.{TC_VALUES[flag]}={value}")
        elif flag in TC_BOOLS:
            out.append(f"++{_MEGATRON}.override_transformer_config.{TC_BOOLS[flag]}=true")
        elif flag == "--bf16":
            out.append(f"{_MEGATRON}.dtype=bfloat16")
        elif flag == "--te-precision-config-file":
            continue  # quant_recipe above, or a YAML that changes nothing
        else:  # pragma: no cover - a megatron backend flag this emitter does not know is a generator bug
            problems.add(UnsupportedByBackend(BACKEND, "*", f"Megatron flag {flag} has no verl 0.9.1 setting here"))
    return out, dict(cfg.env)


def _quantized_tensor(plan) -> Optional[str]:
    return next((t.hf_name for t in plan.tensors if is_quantized(t) and t.mtp is None), None)


def verl_fp8_config(num_layers: int) -> dict:
    """The quantization_config verl 0.9.1 hands vLLM for rollout.quantization=fp8 (vllm_async_server.py
    _apply_quantization: FP8_BLOCK_QUANT_KWARGS, every layer's router `model.layers.{i}.mlp.gate` ignored)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
            "ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(num_layers)]}


def _fp8_rollout(plan, arch, manifest: dict) -> bool:
    """Whether verl's own FP8 rollout serves exactly the plan: vLLM's reading (the vllm backend's derive_formats)
    of the config verl injects must give every served weight the plan's format. verl's sync then quantizes exactly
    the params vLLM built as FP8 (vllm_quant_utils.py is_fp8_weight) and passes the rest as BF16."""
    from ..backends.registry import get_backend
    from ..backends.vllm import MANIFEST, held_in_model_dtype

    argv = list(manifest["engine_args"])
    qcfg = verl_fp8_config(int(arch.config.get("num_hidden_layers", plan.num_layers)))
    argv[argv.index("--hf-overrides") + 1] = json.dumps({"quantization_config": qcfg})
    derived = get_backend("vllm").derive_formats({MANIFEST: json.dumps({**manifest, "engine_args": argv})}, arch)
    for t in plan.tensors:
        got = derived.get(t.hf_name)
        if got is None or (not is_quantized(t) and not held_in_model_dtype(t.precision.weight.kind)):
            continue  # not a served GEMM weight / an fp32 exception the vllm backend checks
        want = t.precision.weight.short() if is_quantized(t) else "bf16"
        if got != want:
            return False  # verl's config would serve `got`: the worker extension serves the plan
    return True


def rollout_overrides(plan, arch, rollout: str, manifest: dict, problems: Problems,
                      plan_file: str = PLAN_FILE) -> tuple[list[str], dict[str, str]]:
    """The rollout's overrides and env from the rollout backend's manifest, refusals into `problems`. A quantized
    vLLM rollout verl's own FP8 path does not serve exactly runs policyc's worker extension (verl_worker.py), which
    reads the plan from `plan_file` (an absolute path in an emitted launch)."""
    quantized = _quantized_tensor(plan)
    fp8 = extension = False
    if quantized is not None:
        kind = next(t.weight.kind.value for t in plan.tensors if t.hf_name == quantized)
        if rollout == "vllm":
            fp8 = kind == "fp8_block" and _fp8_rollout(plan, arch, manifest)
            extension = not fp8
        else:
            why = ("FP8 SGLang rollout: verl's sender decides per parameter name which weights to quantize "
                   "(verl/utils/sglang/sglang_fp8_utils.py _matches_ignored_layer, its own matching of "
                   "SGLANG_FP8_IGNORED_LAYERS) apart from SGLang's own exclusion matching; not verified to agree"
                   if kind == "fp8_block" else
                   f"{kind} SGLang rollout: verl 0.9.1's SGLang server accepts rollout.quantization fp8 only "
                   "(async_sglang_server.py) and its weight sync sends BF16 into whatever SGLang built; verl has "
                   "no worker extension hook for SGLang")
            problems.add(UnsupportedByBackend(BACKEND, quantized, why,
                                              hint="use --rollout vllm (policyc's verl worker extension), keep the "
                                                   "rollout BF16 for verl, or launch with --engine miles"))
            return [], {}
    if rollout == "vllm":
        argv, env = list(manifest["engine_args"]), dict(manifest.get("env") or {})
    else:
        argv, env = list(manifest["server_args"]), dict(manifest.get("env") or {})
    out = [f"{_ROLLOUT}.name={rollout}", f"{_ROLLOUT}.load_format=dummy",
           f"{_ROLLOUT}.quantization=" + ("fp8" if fp8 else "null")]
    if fp8:
        # verl's sync quantizer: its default Triton kernel computes scale_inv = max(amax, 1e-10) / 448 and
        # q = x * (1 / scale_inv); its PyTorch path (this switch) computes TE's scale = 448 / amax,
        # scale_inv = 1 / scale, q = x * scale, scale 1 for an all-zero block: the plan's bytes
        env["VERL_DISABLE_TRITON_FP8"] = "1"
    if extension:
        from .verl_worker import ENV_PLAN, ENV_PLAN_HASH, EXTENSION

        out.append(f"++{_ROLLOUT}.engine_kwargs.vllm.worker_extension_cls={EXTENSION}")
        env[ENV_PLAN], env[ENV_PLAN_HASH] = plan_file, plan.content_hash()
    keys = ROLLOUT_KEYS[rollout]
    tp = dp = 1
    ep = False
    for flag, value in _pairs(argv):
        if flag in keys:
            out.append(f"{_ROLLOUT}.{keys[flag]}={value}")
            tp = int(value) if keys[flag] == "tensor_model_parallel_size" else tp
            dp = int(value) if keys[flag] == "data_parallel_size" else dp
            continue
        if rollout == "vllm" and flag == "--enable-expert-parallel":
            ep = True  # verl: enable_expert_parallel = expert_parallel_size > 1, EP = TP x DP
            continue
        name = flag[2:].replace("-", "_")
        if fp8 and name in ("quantization", "hf_overrides"):
            continue  # verl's own rollout.quantization=fp8 sets both (checked equal to the plan above)
        if extension and name in EXTENSION_SETS:
            pass  # verl's values are None / {} with rollout.quantization=null: the plan's replace nothing
        elif name in VERL_SETS[rollout]:  # pragma: no cover - only quantized plans carry these, refused above
            problems.add(UnsupportedByBackend(BACKEND, "<rollout args>", f"{flag}: verl sets {name} itself and "
                                              "engine_kwargs would override it"))
            continue
        out.append(f"++{_ROLLOUT}.engine_kwargs.{rollout}.{name}=" + ("true" if value is None else _hydra_value(value)))
    if ep:
        out.append(f"{_ROLLOUT}.expert_parallel_size={tp * dp}")
    return out, env


def build_launch(plan, arch, manifest: dict, rollout: str = "vllm", te_version: Optional[str] = None,
                 plan_file: str = PLAN_FILE, megatron_dir: str = "megatron") -> VerlLaunch:
    """The verl launch of a plan the gate accepted (`manifest`: the rollout backend's JSON manifest; `plan_file`,
    `megatron_dir`: where the emitted plan and megatron files are, absolute in an emitted launch). Raises the
    collected UnsupportedByBackend refusals. Pure: nothing is written."""
    if rollout not in ROLLOUTS:
        raise VerlError(f"verl rollout engine must be one of {', '.join(ROLLOUTS)}, got {rollout!r}")
    problems = Problems()
    t_over, t_env = trainer_overrides(plan, te_version, problems, megatron_dir)
    r_over, r_env = rollout_overrides(plan, arch, rollout, manifest, problems, plan_file)
    problems.raise_if_any()
    env = {**t_env, **r_env}
    clash = sorted(k for k in set(t_env) & set(r_env) if t_env[k] != r_env[k])
    if clash:  # pragma: no cover - the backends' variables are disjoint
        raise VerlError(f"trainer and rollout need different values of {', '.join(clash)}")
    base = ['actor_rollout_ref.model.path="$HF_CKPT"', 'data.train_files="$TRAIN_FILES"',
            'data.val_files="$VAL_FILES"', 'trainer.nnodes="$NNODES"', 'trainer.n_gpus_per_node="$GPUS_PER_NODE"',
            "actor_rollout_ref.actor.strategy=megatron"]
    env_over = [f"++{_ENV}.{k}={_hydra_str(v)}" for k, v in sorted(env.items())]
    notes = ["no reference model: the recipe's KL coefficient is 0 (use_kl_loss=False, use_kl_in_reward=False)",
             f"the unset TE variables ({', '.join(megatron.UNSET_ENV)}) are unset in this shell; a Ray cluster "
             "started elsewhere must not set them either"]
    if any(o.startswith(f"{_MODEL}.external_lib=") for o in t_over):
        notes.append(f"the trainer runs policyc's verl plugin (external_lib): precision_dsl must be importable in "
                     f"the trainer's Python and {megatron_dir} readable at that path on every trainer node")
    if any(".worker_extension_cls=" in o for o in r_over):
        notes.append(f"the rollout runs policyc's vLLM worker extension: precision_dsl must be importable in the "
                     f"rollout's Python and {plan_file} readable at that path on every rollout node")
    return VerlLaunch(overrides=base + RL_OVERRIDES + t_over + r_over + env_over, env=env,
                      unset_env=list(megatron.UNSET_ENV), gpus_per_node=default_gpus(plan), notes=notes)


def script_text(plan, launch: VerlLaunch, rollout: str) -> str:
    q = shlex.quote
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by policyc for policy {plan.policy_name!r} on {plan.model} -- plan {plan.content_hash()}",
        f"# Targets: verl {VERL_VERSION} (Hydra config {CONFIG_NAME}), Megatron actor "
        f"({versions.header(megatron.trainer_config(plan).requires)}), "
        + (f"vLLM >= {_vllm_version()} rollout" if rollout == "vllm" else
           f"SGLang {versions.TESTED['sglang']} rollout") + "; weights reach the rollout only through verl's sync.",
        "set -euo pipefail",
        'HF_CKPT="${HF_CKPT:?set HF_CKPT to the BF16 HF checkpoint directory of ' + plan.model + '}"',
        'TRAIN_FILES="${TRAIN_FILES:?set TRAIN_FILES to the training parquet file}"',
        'VAL_FILES="${VAL_FILES:-$TRAIN_FILES}"',
        'NNODES="${NNODES:-1}"',
        f'GPUS_PER_NODE="${{GPUS_PER_NODE:-{launch.gpus_per_node}}}"',
        "",
        "# 1. environment of the driver (and of the local Ray cluster it starts); the same values travel in",
        "#    ray_kwargs.ray_init.runtime_env.env_vars below",
    ]
    lines += [f"export {k}={q(v)}" for k, v in sorted(launch.env.items())]
    lines += [f"unset {' '.join(launch.unset_env)}  # TE's defaults are the exact behaviour", "",
              "# 2. RL: verl's Megatron actor + rollout, every value from the plan",
              f"python -m verl.trainer.main_ppo --config-name {CONFIG_NAME} \\"]
    for o in launch.overrides:
        lines.append(f"  {_shell_word(o)} \\")
    lines.append('  "$@"')
    if launch.notes:
        lines += ["", "# notes:"] + [f"#   {n}" for n in launch.notes]
    return "\n".join(lines) + "\n"


def _shell_word(override: str) -> str:
    """One Hydra override as one shell word: placeholders stay expandable ("$HF_CKPT" in double quotes), anything
    else single-quoted when it needs quoting."""
    if "$" in override:
        return override  # written as key="$NAME": the shell expands it into one word
    return shlex.quote(override)


def _vllm_version() -> str:
    from ..backends.vllm import VLLM_VERSION

    return VLLM_VERSION


def emit_verl_launch(policy: Optional[str], model: str, parallel: Optional[str], out_dir: Path,
                     rollout: str = "vllm", te_version: Optional[str] = None) -> Path:
    """Write the verl launch for a plan the check/emit gate accepts and verl can carry (refusals: exit code 1)."""
    if rollout not in ROLLOUTS:
        raise VerlError(f"--rollout must be one of {', '.join(ROLLOUTS)} for --engine verl, got {rollout!r}")
    path = policy_path(policy)
    arch = load_architecture(model)
    plan = load_plan(str(path), arch, parse_parallel(parallel))
    res = run_gate(plan, arch, ["megatron", rollout], EmitOptions(te_version=te_version, rollout=rollout))
    where = f"run `policyc check {path} --model {model} --rollout {rollout}" + (
        f" --parallel '{parallel}'" if parallel else "") + "` for the full list"
    if not res.ok():
        msgs = "; ".join(d.message for d in res.errors()[:3])
        raise VerlError(f"the plan does not pass `policyc check` ({len(res.errors())} error(s)): {msgs}", where,
                        code=1)
    arts = {a.path: a for a in res.artifacts}
    manifest = json.loads(arts[f"{rollout}/{'serve_args' if rollout == 'vllm' else 'server_args'}.json"].data())
    try:
        launch = build_launch(plan, arch, manifest, rollout, te_version, str(Path(out_dir).resolve() / PLAN_FILE),
                              str(Path(out_dir).resolve() / "megatron"))
    except UnsupportedByBackend as err:
        diags = refusal_diagnostics(err)
        raise VerlError(f"verl {VERL_VERSION} cannot carry this plan ({len(diags)} refusal(s)): "
                        + "; ".join(d.message for d in diags[:3]), diags[0].hint, code=1) from None
    out_dir = Path(out_dir).resolve()
    files = [(a.path, a.data()) for a in res.artifacts]  # the plan, megatron/*, <rollout>/*
    header = f"# policyc {plan.content_hash()} ({plan.policy_name} on {plan.model}); verl {VERL_VERSION}\n"
    files.append((OVERRIDES, (header + "".join(o + "\n" for o in launch.overrides)).encode()))
    files.append((SCRIPT, script_text(plan, launch, rollout).encode()))
    for rel, data in files:
        dest = out_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name("." + dest.name + ".tmp")
        tmp.write_bytes(data)
        if rel == SCRIPT:
            os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    return out_dir / SCRIPT


def read_overrides(text: str, values: dict[str, str]) -> list[str]:
    """The overrides of an emitted verl_overrides.txt with the placeholders replaced as the shell would."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        for k, v in values.items():
            line = line.replace(f'"${k}"', v)
        out.append(line)
    return out
