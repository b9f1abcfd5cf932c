"""`policyc run --engine verl` judged by verl 0.9.1's own configuration code (tests/oracles/verl_oracle.py: Hydra
compose of ppo_megatron_trainer, its config dataclasses, validate_config) and by megatron-core's (the Megatron actor's
override_transformer_config read as TransformerConfig, tests/megatron_oracle.py; a per-module TE recipe read after
verl's own import_external_libs of policyc's verl plugin, by megatron-core 0.16.1 and 0.19.2 on both of verl's
TransformerConfig paths, tests/oracles/verl_oracle.py `megatron`).

Every shipped policy x {qwen3-30b-a3b, deepseek-v3} x layouts x {vllm, sglang} rollout is either accepted by verl
with every value the plan's (trainer recipe per module, rollout layout, the env in the Ray runtime env as strings;
a quantized vLLM rollout through verl's own FP8 path only where its sync quantizer gives the plan's bytes, checked
here on a tensor, otherwise through policyc's worker extension on the vllm backend's own serving args) or refused by
name (tensor + capability). The extension's bytes: tests/test_engine_verl_worker.py."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess

import pytest

import megatron_oracle as mo
from conftest import StrictCliRunner
from matrix import LAYOUTS, POLICIES, arch_of, plan_of
from oracles import verl_oracle as vo
from precision_dsl.backends.common import UnsupportedByBackend
from precision_dsl.backends.registry import EmitOptions
from precision_dsl.cli import app
from precision_dsl.engine import verl as ve
from precision_dsl.engine import verl_worker as vw
from precision_dsl.engine.gate import refusal_diagnostics, run_gate

runner = StrictCliRunner()
MODELS = ["qwen3-30b-a3b", "deepseek-v3"]
VALUES = {"HF_CKPT": "/models/hf", "TRAIN_FILES": "/data/train.parquet", "VAL_FILES": "/data/val.parquet",
          "NNODES": "1", "GPUS_PER_NODE": "8"}
SEED = ("miles-nvfp4", "qwen3-30b-a3b")
# Megatron-LM flag of each TransformerConfig field, as the megatron oracle's own table names them
FLAG_OF = {**{v: k for k, v in mo.FLAG_FIELDS.items()}, **{v: k for k, v in mo.BOOL_FLAGS.items()}}


def _overrides(launch: ve.VerlLaunch) -> list[str]:
    """The launch's overrides as the script passes them, with its own default GPU count."""
    return ve.read_overrides("\n".join(launch.overrides), {**VALUES, "GPUS_PER_NODE": str(launch.gpus_per_node)})


def _manifest(res, rollout: str) -> dict:
    import json

    name = "serve_args" if rollout == "vllm" else "server_args"
    return json.loads(next(a for a in res.artifacts if a.path == f"{rollout}/{name}.json").data())


def _megatron_runs_the_plan(plan, model: str, reading: dict) -> None:
    """megatron-core builds TransformerConfig from what verl holds (parallel sizes + override_transformer_config)
    and runs every decoder module with the plan's recipe."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    meg = reading["megatron"]
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    ours = {k: v for k, v in meg["override_transformer_config"].items()
            if k not in ("recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers",
                         "attention_backend")}  # verl's own defaults
    assert set(ours) <= fields, f"not TransformerConfig fields: {set(ours) - fields}"
    flags = ["--bf16"] if meg["dtype"] == "bfloat16" else []
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
              "expert_tensor_parallel_size"):
        if meg[k] is not None:
            flags += [FLAG_OF[k], str(meg[k])]
    for k, v in ours.items():
        if k == "transformer_impl":
            flags += ["--transformer-impl", v]
        elif v is True:
            flags.append(FLAG_OF[k])
        else:
            flags += [FLAG_OF[k], str(v)]
    config = mo.build_config(arch_of(model), flags, None)
    mods = _decoder_modules(plan)
    got = mo.read_modules(config, sorted(mods))
    wrong = {m: (got[m][1], mo.plan_reading(t)) for m, t in mods.items() if got[m][1] != mo.plan_reading(t)}
    assert not wrong, f"megatron-core runs (got, plan) {dict(list(wrong.items())[:4])}"


def _rollout_layout(plan, rollout: str) -> dict:
    side = plan.parallel.rollout if plan.parallel else None
    tp, ep = (side.tp, side.ep) if side else (1, 1)
    return {"tensor_model_parallel_size": tp, "expert_parallel_size": ep}


def _engine_kwargs_argv(kwargs: dict) -> list[str]:
    """verl's engine_kwargs as the vLLM command-line flags they become (a str value passes as is)."""
    out = []
    for k, v in kwargs.items():
        if k == "worker_extension_cls":
            continue
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def _extension_launch_is_the_plans(plan, key: str, reading: dict, manifest: dict) -> None:
    """What verl holds for a worker-extension rollout is the vllm backend's serving exactly: every engine arg (the
    layout ones through verl's own keys), the plan's quantization_config as one JSON string, the plan in the env."""
    kwargs = reading["rollout"]["engine_kwargs"]["vllm"]
    want = {f: v for f, v in ve._pairs(manifest["engine_args"]) if f not in ve.ROLLOUT_KEYS["vllm"]
            and f != "--enable-expert-parallel"}
    got = dict(ve._pairs(_engine_kwargs_argv(kwargs)))
    assert got == want, (key, set(got) ^ set(want))
    assert json.loads(kwargs["hf_overrides"]) == json.loads(want["--hf-overrides"]), key
    env = reading["env_vars"]
    assert env[vw.ENV_PLAN_HASH] == plan.content_hash() and env[vw.ENV_PLAN].endswith("policyc_plan.json"), key


def _megatron_dir(res, root) -> str:
    """The megatron backend's files of a gate result written under `root` (the launch names its YAML there)."""
    d = root / "megatron"
    d.mkdir(parents=True, exist_ok=True)
    for a in res.artifacts:
        if a.path.startswith("megatron/"):
            (root / a.path).write_bytes(a.data())
    return str(d.resolve())


def _decoder_modules(plan) -> dict:
    """{Megatron module path: its first linear tensor} of the decoder and MTP linears megatron-core quantizes."""
    return {m: ts[0] for m, ts in mo.plan_modules(plan).items()}


def _plugin_reads_the_plan(cells: dict, versions=mo.VERSIONS) -> None:
    """{key: (plan, model, overrides)}: after verl's own import_external_libs of the launch's external_lib, each
    megatron-core release builds verl's TransformerConfig both ways verl does (mbridge, Megatron-Bridge) with a
    RecipeConfig loaded from the launch's YAML, and runs every decoder module with the plan's recipe."""
    launches = {k: ov for k, (_, _, ov) in cells.items()}
    jobs = {k: {"model": model, "modules": sorted(_decoder_modules(plan))} for k, (plan, model, _) in cells.items()}
    for version in versions:
        got = vo.megatron(launches, jobs, version)
        for key, (plan, model, overrides) in cells.items():
            r = got[key]
            assert "error" not in r, f"{key} (megatron-core {version}): {r['error']}"
            recipe = next(o.split("=", 1)[1].strip('"') for o in overrides if f".{ve.RECIPE_KEY}=" in o)
            assert r["external_lib"] == ve.PLUGIN and r["ref_quant_recipe"] == recipe, (key, r)
            for path in mo.CONFIG_PATHS:
                side = r["paths"][path]
                assert "error" not in side, f"{key} ({path}, megatron-core {version}): {side['error']}"
                assert side["recipe_type"] == "RecipeConfig", (key, path, version)
                wrong = {m: (side["modules"][m][1:], mo.plan_reading(t)) for m, t in _decoder_modules(plan).items()
                         if mo.Reading(*side["modules"][m][1:]) != mo.plan_reading(t)}
                assert not wrong, f"{key} ({path}, megatron-core {version}) runs (got, plan) " \
                                  f"{dict(list(wrong.items())[:4])}"


def test_every_cell_is_accepted_by_verl_or_refused_by_name(tmp_path):
    accepted, refused, names = {}, {}, {}
    for model in MODELS:
        arch = arch_of(model)
        for policy in POLICIES:
            for lay in LAYOUTS:
                plan = plan_of(policy, model, lay)
                for rollout in ve.ROLLOUTS:
                    key = f"{policy} x {model} x {lay} x {rollout}"
                    res = run_gate(plan, arch, ["megatron", rollout], EmitOptions(rollout=rollout))
                    if not res.ok():
                        assert all(d.tensor and d.message for d in res.errors()), key
                        refused[key] = [d.message for d in res.errors()]
                        continue
                    root = tmp_path / f"cell{len(accepted) + len(refused)}"
                    try:
                        launch = ve.build_launch(plan, arch, _manifest(res, rollout), rollout,
                                                 plan_file=str(root / "policyc_plan.json"),
                                                 megatron_dir=_megatron_dir(res, root))
                    except UnsupportedByBackend as err:
                        diags = refusal_diagnostics(err)
                        assert diags and all(d.tensor and d.code == "unsupported-by-verl" and d.hint
                                             for d in diags), key
                        refused[key] = [d.message for d in diags]
                        continue
                    accepted[key] = (plan, model, rollout, launch)
                    names[key] = _overrides(launch)
    # the seed recipe: accepted (its per-module TE recipe through policyc's verl plugin, its NVFP4 rollout through
    # policyc's worker extension), on every layout
    for lay in LAYOUTS:
        assert f"{SEED[0]} x {SEED[1]} x {lay} x vllm" in accepted, refused.get(f"{SEED[0]} x {SEED[1]} x {lay} x vllm")
    assert not [k for k, m in refused.items() if any("per-module TE precision recipe" in x for x in m)]
    # FP8 blocks with the last layers BF16 (verl's own FP8 config would quantize them): the worker extension
    assert "fp8-blockwise-hopper x qwen3-30b-a3b x none x vllm" in accepted
    assert len(accepted) >= 12, sorted(accepted)
    readings = vo.check(names)
    for key, (plan, model, rollout, launch) in accepted.items():
        r = readings[key]
        assert "error" not in r, f"{key}: verl refuses: {r['error']}"
        ro = r["rollout"]
        kwargs = ro["engine_kwargs"][rollout]
        extension = kwargs.get("worker_extension_cls") == vw.EXTENSION
        verl_fp8 = any(t.precision.is_quantized for t in plan.tensors) and not extension
        assert ro["name"] == rollout and ro["quantization"] == ("fp8" if verl_fp8 else None), key
        assert ro["quantization_config_file"] is None, key
        assert ro["load_format"] == "dummy" and ro["dtype"] == "bfloat16", key
        for k, v in _rollout_layout(plan, rollout).items():
            assert ro[k] == v, (key, k, ro[k], v)
        # engine_kwargs hold no key verl sets itself (they are spread last over verl's own args), but with the
        # extension: its class and the quantization keys verl leaves None / {} for rollout.quantization=null
        allowed = (ve.EXTENSION_SETS | {"worker_extension_cls"}) if extension else set()
        assert not set(kwargs) & (ve.VERL_SETS[rollout] - allowed), key
        if extension:
            _extension_launch_is_the_plans(plan, key, r, _manifest(run_gate(plan, arch_of(model), ["megatron", rollout],
                                                                            EmitOptions(rollout=rollout)), rollout))
        assert r["need_reference_policy"] is False and r["qat"]["enable"] is False, key
        assert r["env_vars"] == launch.env and all(isinstance(v, str) for v in r["env_vars"].values()), key
        recipe = ve.RECIPE_KEY in r["megatron"]["override_transformer_config"]
        assert recipe == any(o.startswith(f"{ve._MODEL}.external_lib=") for o in launch.overrides), key
        if not recipe:
            _megatron_runs_the_plan(plan, model, r)
    with_recipe = {k: (plan, model, names[k]) for k, (plan, model, _, _) in accepted.items()
                   if ve.RECIPE_KEY in readings[k]["megatron"]["override_transformer_config"]}
    assert any(k.startswith(f"{SEED[0]} x {SEED[1]} ") for k in with_recipe), sorted(with_recipe)
    assert any(" x deepseek-v3 x " in k for k in with_recipe), sorted(with_recipe)
    _plugin_reads_the_plan(with_recipe)


def test_trainer_overrides_carry_a_global_recipe():
    """A plan whose quantized modules all share the global recipe (no per-module YAML needed) reaches verl's
    Megatron actor as override_transformer_config, and megatron-core runs it module by module as the plan says."""
    from precision_dsl.backends.common import Problems

    plan = plan_of("fp8-blockwise-hopper", "qwen3-30b-a3b", "none")
    problems = Problems()
    over, env = ve.trainer_overrides(plan, None, problems)
    assert not problems.items, [str(p) for p in problems.items]
    assert f"++{ve._MEGATRON}.override_transformer_config.fp8_recipe=blockwise" in over
    assert env == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    bf16 = plan_of("bf16", "qwen3-30b-a3b", "none")
    res = run_gate(bf16, arch_of("qwen3-30b-a3b"), ["megatron", "vllm"], EmitOptions(rollout="vllm"))
    base = ve.build_launch(bf16, arch_of("qwen3-30b-a3b"), _manifest(res, "vllm"), "vllm")
    base_over = [o for o in base.overrides if not o.startswith(f"++{ve._MEGATRON}.override_transformer_config.")
                 and not o.startswith(f"{ve._MEGATRON}.")]
    env_over = [f"++{ve._ENV}.{k}={ve._hydra_str(v)}" for k, v in env.items()]
    r = vo.check({"fp8": ve.read_overrides("\n".join(base_over + over + env_over), VALUES)})["fp8"]
    assert "error" not in r, r["error"]
    assert r["env_vars"] == env
    _megatron_runs_the_plan(plan, "qwen3-30b-a3b", r)
    assert not any(ve.RECIPE_KEY in o or "external_lib" in o for o in over)  # no per-module recipe: no plugin
    # DeepSeek-V3 keeps its shared experts / kv_b_proj BF16 inside FP8 layers: only a per-module recipe says that,
    # so that launch names the YAML and the plugin
    problems = Problems()
    over, _ = ve.trainer_overrides(plan_of("fp8-blockwise-hopper", "deepseek-v3", "none"), None, problems, "/o/megatron")
    assert not problems.items, [str(p) for p in problems.items]
    assert f'++{ve._MEGATRON}.override_transformer_config.{ve.RECIPE_KEY}="/o/megatron/te_precision.yaml"' in over
    assert f"{ve._MODEL}.external_lib={ve.PLUGIN}" in over


def test_verl_fp8_sync_quantizer_path_is_the_plans():
    """verl's FP8 weight-sync quantizer (fp8_kernel.py): its PyTorch path, which the launch selects with
    VERL_DISABLE_TRITON_FP8=1, gives the plan's FP8-block bytes and scales; its default Triton kernel does not."""
    import torch

    from precision_dsl.formats import fp8_block

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 384, generator=g) * torch.logspace(-3, 1, 384)).to(torch.bfloat16)
    x[:128, 256:] = 0  # an all-zero block: TE's scale 1
    theirs = vo.fp8_blockwise(x.float().tolist())
    ours = fp8_block.quantize(x, "e4m3", (128, 128), pow2=False)

    def same(path):
        b = torch.tensor(theirs[path]["bytes"], dtype=torch.uint8)
        s = torch.tensor(theirs[path]["scale_inv"], dtype=torch.float32).reshape(ours.scale.shape)
        return torch.equal(b, ours.data) and torch.equal(s, ours.scale), (b == ours.data).float().mean().item()

    exact, _ = same("pytorch")
    assert exact, "verl's PyTorch FP8 path no longer gives the plan's bytes"
    exact, agree = same("triton")
    assert not exact and agree > 0.9, agree  # the same format, not the same quantizer
    launch_env = ve.build_launch(*_fp8_everywhere()).env
    assert launch_env["VERL_DISABLE_TRITON_FP8"] == "1"


def _fp8_everywhere():
    """FP8 blocks on every decoder linear of Qwen3-30B-A3B but the routers: what verl's own FP8 rollout serves."""
    from precision_dsl.resolve import resolve

    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    (d / "fp8-all.policy").write_text('policy "fp8-all" {\n  target hopper\n  default bf16\n'
                                     '  attn: fp8_block(scales=fp32)\n  routed_experts: fp8_block(scales=fp32)\n}\n')
    arch = arch_of("qwen3-30b-a3b")
    plan = resolve(d / "fp8-all.policy", arch, None)
    res = run_gate(plan, arch, ["megatron", "vllm"], EmitOptions(rollout="vllm"))
    assert res.ok(), [d.message for d in res.errors()][:3]
    return plan, arch, _manifest(res, "vllm"), "vllm"


def test_fp8_rollout_verl_can_carry_is_accepted():
    """A plan verl's FP8 rollout serves exactly: verl accepts the launch, its rollout quantization is fp8 (verl's
    own config, no engine_kwargs quantization), and megatron-core runs the actor's recipe as the plan says."""
    plan, arch, manifest, rollout = _fp8_everywhere()
    launch = ve.build_launch(plan, arch, manifest, rollout)
    r = vo.check({"fp8": _overrides(launch)})["fp8"]
    assert "error" not in r, r["error"]
    assert r["rollout"]["quantization"] == "fp8"
    assert not {"quantization", "hf_overrides"} & set(r["rollout"]["engine_kwargs"]["vllm"])
    assert r["env_vars"] == launch.env and r["env_vars"]["VLLM_USE_DEEP_GEMM"] == "0"
    assert r["megatron"]["override_transformer_config"]["fp8_recipe"] == "blockwise"
    _megatron_runs_the_plan(plan, "qwen3-30b-a3b", r)


def test_cli_writes_the_verl_launch(tmp_path):
    out = tmp_path / "verl"
    r = runner.invoke(app, ["run", "--engine", "verl", "bf16", "--model", "qwen3-30b-a3b", "--parallel",
                            "trainer:tp=2,ep=4,etp=1 rollout:tp=4,ep=4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    script = (out / ve.SCRIPT).read_text()
    plan_hash = next(line for line in script.splitlines() if "-- plan " in line).split("-- plan ")[1]
    assert plan_hash in (out / ve.OVERRIDES).read_text() and (out / "policyc_plan.json").exists()
    assert (out / "megatron" / "args.txt").exists() and (out / "vllm" / "serve_args.json").exists()
    assert subprocess.run(["bash", "-n", str(out / ve.SCRIPT)]).returncode == 0
    assert "python -m verl.trainer.main_ppo --config-name ppo_megatron_trainer" in script
    # the script passes exactly the overrides of verl_overrides.txt (what the oracle judged)
    body = script[script.index("ppo_megatron_trainer \\\n") + len("ppo_megatron_trainer \\\n"):script.index('  "$@"')]
    words = [shlex.split(line.rstrip("\\ ")) for line in body.splitlines()]
    assert all(len(w) == 1 for w in words), words  # one override per line, one shell word each
    listed = [ln for ln in (out / ve.OVERRIDES).read_text().splitlines() if not ln.startswith("#")]
    assert [w[0] for w in words] == [ln.replace('"$', "$").replace('_FILES"', "_FILES").replace('_CKPT"', "_CKPT")
                                     .replace('NNODES"', "NNODES").replace('_NODE"', "_NODE") for ln in listed]


@pytest.mark.parametrize("args,needle,code", [
    (["run", "--engine", "verl", "bf16", "--model", "tiny-moe", "--rollout", "trtllm"], "--rollout must be", 2),
    (["run", "--engine", "verl", "nvfp4-weight-only", "--model", "qwen3-30b-a3b"], "does not pass `policyc check`", 1),
])
def test_cli_refusals_are_messages(tmp_path, args, needle, code):
    r = runner.invoke(app, args + ["--out", str(tmp_path / "o")])
    assert r.exit_code == code, r.output
    assert needle in " ".join(r.output.split()), r.output
    assert not (tmp_path / "o" / ve.SCRIPT).exists()


def _emitted(tmp_path, policy: str, model: str) -> tuple:
    """`policyc run --engine verl` into tmp_path: (plan, the overrides of verl_overrides.txt with the placeholders
    filled, the emitted directory)."""
    from precision_dsl.plan import Plan

    out = tmp_path / "verl"
    r = runner.invoke(app, ["run", "--engine", "verl", policy, "--model", model, "--out", str(out)])
    assert r.exit_code == 0, r.output
    plan = Plan.from_json((out / "policyc_plan.json").read_text())
    return plan, ve.read_overrides((out / ve.OVERRIDES).read_text(), VALUES), out.resolve()


def test_seed_recipe_is_one_verl_launch(tmp_path):
    """The seed recipe (Qwen3-30B-A3B, per-token NVFP4 routed experts, last 15% BF16, shared experts BF16) as the
    launch `policyc run --engine verl` writes: verl's config code accepts it; the Megatron actor holds the TE
    precision YAML the Miles launch passes as --te-precision-config-file (by absolute path, as quant_recipe) with
    policyc's verl plugin as external_lib and the trainer's NVTE_* env in the Ray runtime env; the rollout runs
    policyc's worker extension on the vllm backend's own serving args (ModelOpt NVFP4 config as hf_overrides, the
    per-token MoE activation as quantization_config, one string each)."""
    from precision_dsl.backends.megatron import trainer_config

    plan, overrides, out = _emitted(tmp_path, *SEED)
    yaml = out / "megatron" / "te_precision.yaml"
    assert yaml.is_file() and "--te-precision-config-file" in (out / "megatron" / "args.txt").read_text()
    r = vo.check({"seed": overrides})["seed"]
    assert "error" not in r, r["error"]
    assert r["megatron"]["override_transformer_config"][ve.RECIPE_KEY] == str(yaml)
    te_env = trainer_config(plan).env
    assert te_env["NVTE_NVFP4_ROW_SCALED_ACTIVATION"] == "1"  # the per-token activation switch
    assert {k: r["env_vars"][k] for k in te_env} == te_env
    ro = r["rollout"]
    assert ro["quantization"] is None and ro["quantization_config_file"] is None and ro["load_format"] == "dummy"
    kwargs = ro["engine_kwargs"]["vllm"]
    assert kwargs["worker_extension_cls"] == vw.EXTENSION and kwargs["quantization"] == "modelopt_fp4"
    assert json.loads(kwargs["quantization_config"]) == {"moe": {"activation": "nvfp4_per_token"}}
    assert json.loads(kwargs["hf_overrides"])["quantization_config"]["quant_algo"] == "NVFP4"
    manifest = json.loads((out / "vllm" / "serve_args.json").read_text())
    _extension_launch_is_the_plans(plan, "seed", r, manifest)
    assert r["env_vars"][vw.ENV_PLAN] == str(out / "policyc_plan.json")
    script = (out / ve.SCRIPT).read_text()
    assert "policyc's verl plugin" in script and str(out / "megatron") in script


def test_seed_trainer_recipe_reaches_megatron_core_through_the_plugin(tmp_path):
    """The seed launch's Megatron actor, as verl builds it: verl's import_external_libs imports the plugin the
    launch names, then megatron-core 0.16.1 and 0.19.2 (each its own code: TransformerConfig on the mbridge path,
    setattr + deferred __post_init__ on the Megatron-Bridge path) hold a RecipeConfig loaded from the YAML and run
    every linear of every decoder layer with the plan's recipe: the Miles launch's reading."""
    plan, overrides, _ = _emitted(tmp_path, *SEED)
    mods = _decoder_modules(plan)
    kinds = {mo.plan_reading(t).kind for t in mods.values()}
    assert kinds == {"nvfp4", "bf16"}, kinds  # routed experts NVFP4, shared experts / attention / last layers BF16
    _plugin_reads_the_plan({"seed": (plan, SEED[1], overrides)})


def test_without_the_plugin_megatron_core_fails_loudly_and_the_plugin_names_the_key(tmp_path):
    """The plain str verl holds is never silently ignored: without the plugin megatron-core keeps it and its
    per-module lookup (get_quant_config_or_none, what GPTModel runs for every TE module) raises. With the plugin a
    missing, relative or invalid YAML is an error naming the launch key."""
    plan, overrides, out = _emitted(tmp_path, *SEED)
    modules = sorted(_decoder_modules(plan))[:4]
    job = {"model": SEED[1], "modules": modules}
    r = vo.megatron({"seed": overrides}, {"seed": job}, "0.16.1", plugin=False)["seed"]
    for path in mo.CONFIG_PATHS:
        assert "'str' object has no attribute 'match'" in r["paths"][path]["error"], (path, r)
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs: [1, 2]\nmatchers: 7\n")
    key = f"{ve._MEGATRON}.override_transformer_config.{ve.RECIPE_KEY}="
    cases = {"missing": str(tmp_path / "none.yaml"), "relative": "megatron/te_precision.yaml", "invalid": str(bad)}
    launches = {name: [o if not o.startswith("++" + key) else f'++{key}"{v}"' for o in overrides]
                for name, v in cases.items()}
    got = vo.megatron(launches, {name: job for name in cases}, "0.16.1")
    for name, needle in (("missing", "cannot read"), ("relative", "not an absolute path"),
                         ("invalid", "cannot read")):
        for path in mo.CONFIG_PATHS:
            err = got[name]["paths"][path]["error"]
            assert err.startswith("VerlPluginError") and key.rstrip("=") in err and needle in err, (name, path, err)


def test_plugin_is_lazy_idempotent_and_leaves_recipe_objects_alone():
    """policyc names the plugin without importing it (importing it patches megatron-core); imported (twice), it
    wraps TransformerConfig.__post_init__ once, converts a PathLike, passes a RecipeConfig / None untouched, and a
    second __post_init__ (Megatron-Bridge's finalize may run again) changes nothing."""
    code = """
import sys, pathlib, importlib
import precision_dsl.engine.verl as ve
assert 'megatron.core' not in sys.modules and ve.PLUGIN not in sys.modules
p = importlib.import_module(ve.PLUGIN)
assert p.MODULE == ve.PLUGIN and p.KEY == ve.RECIPE_KEY and p.INSTALLED
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.quantization.quant_config import RecipeConfig
wrapped = TransformerConfig.__post_init__
assert p.install() and TransformerConfig.__post_init__ is wrapped
yaml = pathlib.Path(sys.argv[1]) / 'r.yaml'
yaml.write_text('configs:\\n  bf16: {transformer_engine_config_type: TEQuantizationParams}\\n'
                'matchers:\\n  all: {type: glob, pattern: "*", config: bf16, enabled: true}\\n')
kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
c = TransformerConfig(**kw, quant_recipe=yaml)
assert isinstance(c.quant_recipe, RecipeConfig), type(c.quant_recipe)
same = c.quant_recipe
c.__post_init__()
assert c.quant_recipe is same
assert TransformerConfig(**kw).quant_recipe is None
assert TransformerConfig(**kw, quant_recipe=same).quant_recipe is same
"""
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_worker_extension_module_imports_nothing_heavy():
    """The dotted path vLLM resolves (importlib + getattr) is importable without vLLM / verl: the class is built on
    first access, inside the vLLM worker; any other name is an AttributeError."""
    code = ("import sys; import precision_dsl.engine.verl_worker as w; "
            "bad = [m for m in ('torch', 'vllm', 'verl') if m in sys.modules]; assert not bad, bad; "
            "assert w.EXTENSION == w.__name__ + '.PolicycWorkerExtension'\n"
            "try:\n    w.Other\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')")
    r = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_worker_plan_file_is_checked(tmp_path):
    from precision_dsl.backends.common import plan_json_bytes

    plan = plan_of(*SEED, "none")
    f = tmp_path / "policyc_plan.json"
    f.write_bytes(plan_json_bytes(plan))
    assert vw.load_plan_file(str(f), plan.content_hash()).content_hash() == plan.content_hash()
    for path, want, needle in ((None, None, vw.ENV_PLAN), (str(f), "sha256:0", "was emitted for"),
                               (str(tmp_path / "none.json"), None, "cannot read")):
        with pytest.raises(vw.VerlWorkerError, match=needle):
            vw.load_plan_file(path, want)


def test_cli_writes_the_extension_launch_with_the_plan_beside_it(tmp_path):
    """An MXFP8 rollout (global MXFP8 trainer recipe): the launch runs policyc's worker extension, whose plan file is
    the emitted policyc_plan.json by absolute path, with its hash."""
    out = tmp_path / "verl"
    r = runner.invoke(app, ["run", "--engine", "verl", "mxfp8-e2e", "--model", "qwen3-30b-a3b", "--out", str(out)])
    assert r.exit_code == 0, r.output
    listed = (out / ve.OVERRIDES).read_text()
    assert f"engine_kwargs.vllm.worker_extension_cls={vw.EXTENSION}" in listed
    plan_file = out.resolve() / "policyc_plan.json"
    assert f'{vw.ENV_PLAN}="{plan_file}"' in listed
    from precision_dsl.plan import Plan

    plan = Plan.from_json(plan_file.read_text())
    assert f'{vw.ENV_PLAN_HASH}="{plan.content_hash()}"' in listed
    assert vw.load_plan_file(str(plan_file), plan.content_hash()).content_hash() == plan.content_hash()


def test_worker_extension_is_verls_class_extended_as_vllm_loads_it(tmp_path):
    """verl 0.9.1 and vLLM 0.33.0 together (tests/oracles/verl_oracle.py `extension`): vLLM resolves the dotted path
    the launch names to a subclass of verl's vLLMColocateWorkerExtension, with no attribute clashing with vLLM's
    Worker, verl's RPCs inherited, its weight sync and process setup replaced (no verl ModelOpt-QAT state), and the
    plan read from the file the launch points at."""
    from precision_dsl.backends.common import plan_json_bytes

    plan = plan_of(*SEED, "none")
    f = tmp_path / "policyc_plan.json"
    f.write_bytes(plan_json_bytes(plan))
    r = vo.extension(vw.EXTENSION, {vw.ENV_PLAN: str(f), vw.ENV_PLAN_HASH: plan.content_hash()})
    assert r["subclasses_verl"] and r["mro"][:2] == [vw.EXTENSION, vw.VERL_EXTENSION], r["mro"]
    assert r["clashes"] == [], r["clashes"]
    assert r["verl_rpcs"] == ["update_weights_from_ipc", "monkey_patch_model", "_get_zmq_handle"]
    assert r["overrides"] == ["__new__", "update_weights_from_ipc"]
    assert r["instance"] == {"_is_qat_model": False, "_is_modelopt_qat": False}
    assert r["plan_hash"] == plan.content_hash()
