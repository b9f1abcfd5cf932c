"""verl 0.9.1, asked directly: does its own configuration code accept the launch policyc emits, and what does it make
of each value?

How verl is obtained: `pip download --no-deps` of verl 0.9.1 and of the configuration libraries it composes with
(hydra-core 1.3.2, omegaconf 2.3.0, and the antlr4 runtime 4.9.3 omegaconf's grammar was generated with; that one is
published as a pure-Python sdist, whose `src/antlr4` is taken as is) into the one wheel cache
($POLICYC_ORACLE_CACHE/wheels, ~2 MB), unpacked once into `verl-0.9.1-site`. Nothing of verl is copied into this
repository. verl runs in a separate process (`check`): the site goes first on its sys.path, so this session's own
antlr4 (a newer runtime) is never shadowed, and the heavy modules verl imports at config time but that this box does
not have (ray, tensordict, transfer_queue, codetiming, wandb, orjson, datasets, pandas) are inert stubs
(tests/oracles/_sandbox.py); every verl, Hydra and OmegaConf module is real.

What is asked, per launch (the Hydra overrides of `verl_overrides.txt`, placeholders filled with absolute paths):
  * `hydra.compose("ppo_megatron_trainer", overrides)` on verl's own config directory (unknown keys without `+`,
    type errors, bad interpolations are refused here);
  * `verl.utils.config.omega_conf_to_dataclass` of the rollout, actor and actor.megatron sections
    (RolloutConfig.__post_init__: EP = TP x DP, the name checks; McoreActorConfig / McoreEngineConfig);
  * `verl.utils.config.validate_config(cfg, need_reference_policy(cfg), need_critic(cfg))`, as main_ppo runs it;
  * the values verl then holds: the rollout dataclass (name, quantization, load_format, parallel sizes,
    engine_kwargs), the Megatron engine's parallel sizes / dtype / override_transformer_config, and the Ray runtime
    env as main_ppo passes it to ray.init (OmegaConf.to_container of ray_kwargs.ray_init).
Also `fp8_blockwise(x)`: verl's own FP8 weight-sync quantizer (verl/utils/kernel/fp8_kernel.py) on a tensor, both
of its paths: the Triton kernel it uses wherever Triton imports (run by Triton's interpreter here, TRITON_INTERPRET=1)
and the PyTorch path VERL_DISABLE_TRITON_FP8=1 selects; the bytes and scales each sends.

Where verl cannot be obtained or loaded, OracleUnavailable is raised with the reason (tests fail, never skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

from ._wheels import download, extract, install_site

VERL_VERSION = "0.9.1"
WHEELS = (f"verl=={VERL_VERSION}", "hydra-core==1.3.2", "omegaconf==2.3.0")
ANTLR = "antlr4-python3-runtime==4.9.3"  # omegaconf 2.3.0's grammar needs exactly this runtime
STUBS = ("ray", "tensordict", "transfer_queue", "codetiming", "wandb", "orjson", "datasets", "pandas")
PACKAGES = ("verl", "hydra", "omegaconf", "antlr4")
CONFIG_NAME = "ppo_megatron_trainer"


class OracleUnavailable(RuntimeError):
    """verl could not be obtained or loaded: the reason, for a failing test."""


def fetch_site() -> Path:
    """The unpacked verl wheel + Hydra + OmegaConf + antlr4 4.9.3, downloaded with pip once and reused."""
    whls = [download(req, OracleUnavailable) for req in WHEELS]
    sdist = download(ANTLR, OracleUnavailable, source=True)

    def fill(tmp: Path) -> None:
        for whl in whls:
            extract(whl, tmp)
        with tarfile.open(sdist) as t:
            top = sdist.name[:-len(".tar.gz")]
            members = [m for m in t.getmembers() if m.name.startswith(f"{top}/src/antlr4/") and m.isfile()]
            for m in members:
                m.name = m.name[len(f"{top}/src/"):]
            t.extractall(tmp, members, filter="data")

    return install_site(f"verl-{VERL_VERSION}-site", fill, json.dumps(sorted(p.name for p in whls + [sdist])))


def _child(tmp: Path, request: dict, code: Callable[[str, str], str], timeout: float, what: str) -> dict:
    """Run `code(src, dst)` in a fresh interpreter: it reads the JSON `request` from src and writes its answer to
    dst (the engines' modules never enter this process)."""
    src, dst = tmp / "in.json", tmp / "out.json"
    src.write_text(json.dumps(request))
    r = subprocess.run([sys.executable, "-c", code(str(src), str(dst))], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if r.returncode != 0 or not dst.exists():
        raise OracleUnavailable(f"{what} process failed (rc {r.returncode}): "
                                f"{(r.stderr or r.stdout).strip()[-1500:]}")
    return json.loads(dst.read_text())


def _ask(request: dict, timeout: float = 900) -> dict:
    site = fetch_site()
    repo = str(Path(__file__).resolve().parents[2])  # precision_dsl (the verl plugin, the architectures)
    tests = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as d:
        return _child(Path(d), request, lambda src, dst: (
            f"import sys; sys.path[:0] = [{tests!r}, {repo!r}]; from oracles.verl_oracle import _serve; "
            f"_serve({str(site)!r}, {src!r}, {dst!r})"), timeout, f"verl {VERL_VERSION}")


def check(launches: dict[str, list[str]]) -> dict[str, dict]:
    """{key: verl's reading of the launch} or {key: {"error": verl's own error text}} for every override list."""
    return _ask({"op": "check", "launches": launches})


def megatron(launches: dict[str, list[str]], jobs: dict[str, dict], version: str = "0.16.1",
             plugin: bool = True) -> dict[str, dict]:
    """verl's Megatron actor config of each launch, read by megatron-core `version` (the installed 0.16.1, or the
    release's wheel from tests/megatron_oracle.py fetch_site, first on the verl process's sys.path).

    Per launch: Hydra compose; `import_external_libs(actor_rollout_ref.model.external_lib)`, verl's own call, as
    HFModelConfig.__post_init__ makes it in every worker (verl/workers/config/model.py:149; skipped with
    plugin=False: what megatron-core does with the plain value); the override_transformer_config verl's
    McoreEngineConfig holds + its parallel sizes and dtype as a TransformerConfig, built both ways verl builds one
    (megatron_oracle.config_from_fields: "mbridge", "bridge"); megatron-core's per-module reading of `jobs[key]`
    {"model", "modules"} (megatron_oracle.read_modules). Answer: {key: {"external_lib", "ref_quant_recipe",
    "paths": {path: {"recipe_type", "modules": {module: [rank, kind, fp8_format]}} or {"error"}}}} or
    {key: {"error"}}."""
    from megatron_oracle import fetch_site as megatron_site

    msite = None if version == "0.16.1" else str(megatron_site(version))
    return _ask({"op": "megatron", "launches": launches, "jobs": jobs, "version": version, "plugin": plugin,
                 "megatron_site": msite})


def fp8_blockwise(values: list[list[float]], block: int = 128) -> dict:
    """verl's FP8 weight-sync quantizer on one bf16 tensor: {"triton"|"pytorch": {"bytes": [[uint8]],
    "scale_inv": [[float]]}}."""
    return _ask({"op": "fp8", "values": values, "block": block})


# ---------------------------------------------------------------------------------------------------------------
# the verl process
# ---------------------------------------------------------------------------------------------------------------
def _serve(site: str, src: str, dst: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # verl's Triton kernels on this CPU (read when triton is imported)
    sys.path.insert(0, site)
    from oracles._sandbox import Sandbox

    request = json.loads(Path(src).read_text())
    if request.get("megatron_site"):
        sys.path.insert(0, request["megatron_site"])  # that release shadows the installed megatron-core here only
    with Sandbox(site, PACKAGES, stubs=STUBS):
        import verl

        if request["op"] == "check":
            out = _check(verl, request["launches"])
        elif request["op"] == "megatron":
            out = _megatron(verl, request)
        else:
            out = _fp8(request)
    Path(dst).write_text(json.dumps(out))


def _plain(obj):
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def _check(verl, launches: dict[str, list[str]]) -> dict[str, dict]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    out: dict[str, dict] = {}
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        for key, overrides in launches.items():
            try:
                cfg = compose(CONFIG_NAME, overrides=list(overrides))
                rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
                actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
                engine = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron)
                ref = need_reference_policy(cfg)
                validate_config(cfg, use_reference_policy=ref, use_critic=need_critic(cfg))
                ray_init = OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True)
                out[key] = {
                    "rollout": {k: _plain(getattr(rollout, k)) for k in (
                        "name", "quantization", "quantization_config_file", "load_format", "dtype",
                        "tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size",
                        "pipeline_model_parallel_size", "engine_kwargs", "n")},
                    "actor": {"strategy": actor.strategy, "use_kl_loss": actor.use_kl_loss},
                    "megatron": {k: _plain(getattr(engine, k)) for k in (
                        "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                        "expert_tensor_parallel_size", "dtype", "override_transformer_config")},
                    "qat": _plain(getattr(engine, "qat", None)),
                    "env_vars": (ray_init.get("runtime_env") or {}).get("env_vars") or {},
                    "need_reference_policy": bool(ref),
                }
            except BaseException as err:  # verl's own refusal is the answer
                out[key] = {"error": f"{type(err).__name__}: {err}"}
    return out


# verl's own defaults in override_transformer_config (trainer/config/engine/megatron.yaml), not the plan's
VERL_TC_DEFAULTS = ("recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers",
                    "attention_backend")


def _megatron(verl, request: dict) -> dict[str, dict]:
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import megatron_oracle as mo
    from precision_dsl.arch import load_architecture
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    mo.load(request["version"])
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    out: dict[str, dict] = {}
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        for key, overrides in request["launches"].items():
            job = request["jobs"][key]
            try:
                cfg = compose(CONFIG_NAME, overrides=list(overrides))
                lib = cfg.actor_rollout_ref.model.external_lib
                if request["plugin"]:
                    import_external_libs(lib)
                engine = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron)
                ref = OmegaConf.to_container(cfg.actor_rollout_ref.ref.megatron.override_transformer_config,
                                             resolve=True)
            except BaseException as err:
                out[key] = {"error": f"{type(err).__name__}: {err}"}
                continue
            fields = {k: v for k, v in dict(engine.override_transformer_config).items() if k not in VERL_TC_DEFAULTS}
            for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                      "expert_tensor_parallel_size"):
                if getattr(engine, k) is not None:  # verl's provider_overrides carry the engine's parallel sizes
                    fields[k] = getattr(engine, k)
            fields["bf16"] = engine.dtype == "bfloat16"
            fields["params_dtype"] = torch.bfloat16 if fields["bf16"] else torch.float32
            entry = {"external_lib": lib, "ref_quant_recipe": ref.get("quant_recipe"), "paths": {}}
            arch = load_architecture(job["model"])
            for path in mo.CONFIG_PATHS:
                try:
                    config = mo.config_from_fields(arch, fields, path)
                    mods = mo.read_modules(config, list(job["modules"]))
                    entry["paths"][path] = {"recipe_type": type(config.quant_recipe).__name__,
                                            "modules": {m: [rank, r.kind, r.fp8_format]
                                                        for m, (rank, r) in mods.items()}}
                except BaseException as err:  # megatron-core's (or the plugin's) refusal is the answer
                    entry["paths"][path] = {"error": f"{type(err).__name__}: {err}"}
            out[key] = entry
    return out


def _fp8(request: dict) -> dict:
    import torch

    from verl.utils.kernel import fp8_kernel

    x = torch.tensor(request["values"], dtype=torch.float32).to(torch.bfloat16)
    block = [request["block"], request["block"]]
    if not fp8_kernel._TRITON_AVAILABLE:
        raise OracleUnavailable("verl's fp8_kernel found no Triton (the test extra installs it)")
    out = {}
    for path, fn in (("triton", fp8_kernel.scaled_fp8_blockwise_triton),
                     ("pytorch", fp8_kernel._scaled_fp8_blockwise_pytorch)):
        q, s = fn(x, block)
        out[path] = {"bytes": q.view(torch.uint8).tolist(), "scale_inv": s.float().reshape(-1).tolist()}
    return out


# ---------------------------------------------------------------------------------------------------------------
# a worker extension class as verl 0.9.1 + vLLM 0.33.0 see it (both engines' own modules, one process)
# ---------------------------------------------------------------------------------------------------------------
def extension(qualname: str, env_vars: dict[str, str], timeout: float = 900) -> dict:
    """vLLM 0.33's `resolve_obj_by_qualname` of `qualname` with verl 0.9.1 importable beside it: the class's MRO,
    whether it subclasses verl's vLLMColocateWorkerExtension, the attributes that clash with vLLM's Worker (vLLM's
    injection asserts there are none, vllm/v1/worker/worker_base.py init_worker), and what its `__new__` leaves on
    an instance of a class mixing it in (with `env_vars` in the environment). verl finds vLLM's version through
    package metadata (verl/third_party/vllm/__init__.py), which the unpacked vLLM site lacks: a METADATA naming
    0.33.0 is written beside it."""
    from .vllm_oracle import fetch_site as vllm_site

    site, vsite = fetch_site(), vllm_site("0.33.0")
    with tempfile.TemporaryDirectory() as d:
        meta = Path(d) / "meta" / "vllm-0.33.0.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
        tests = str(Path(__file__).resolve().parents[1])
        return _child(Path(d), {"qualname": qualname, "env": env_vars}, lambda src, dst: (
            f"import sys; sys.path.insert(0, {tests!r}); from oracles.verl_oracle import _serve_extension; "
            f"_serve_extension({str(site)!r}, {str(vsite)!r}, {str(meta.parent)!r}, {src!r}, {dst!r})"),
            timeout, f"verl {VERL_VERSION} + vLLM 0.33.0")


def _serve_extension(site: str, vsite: str, meta: str, src: str, dst: str) -> None:
    from oracles._sandbox import Sandbox, env
    from oracles._wheels import cache_dir
    from oracles.vllm_oracle import ENV, STUBS as VLLM_STUBS, _cpu_platform

    request = json.loads(Path(src).read_text())
    sys.path[:0] = [meta, site]
    sandbox = Sandbox(vsite, ("vllm",) + PACKAGES, tuple(VLLM_STUBS["0.33.0"]) + STUBS)
    with sandbox, env({**ENV, "VLLM_CACHE_ROOT": str(cache_dir() / "vllm-0.33.0-cache"), **request["env"]}), \
            _cpu_platform("0.33.0"):
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.worker.gpu_worker import Worker

        cls = resolve_obj_by_qualname(request["qualname"])
        verl_cls = resolve_obj_by_qualname("verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension")
        mixed = type("MixedWorker", (cls,), {})  # what vLLM's injection makes of a worker class (a base appended)
        instance = mixed.__new__(mixed, vllm_config=None)
        out = {"mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__],
               "subclasses_verl": issubclass(cls, verl_cls),
               "clashes": [a for a in dir(cls) if not a.startswith("__") and hasattr(Worker, a)],
               "verl_rpcs": [a for a in ("update_weights_from_ipc", "monkey_patch_model", "_get_zmq_handle")
                             if callable(getattr(cls, a, None))],
               "overrides": [a for a in ("__new__", "update_weights_from_ipc", "_update_weights")
                             if a in vars(cls)],
               "instance": {k: _plain(getattr(instance, k, None)) for k in ("_is_qat_model", "_is_modelopt_qat")},
               "plan_hash": getattr(getattr(instance, "_policyc_plan", None), "content_hash", lambda: None)()}
    Path(dst).write_text(json.dumps(out))
