"""SGLang 0.5.23, asked directly: what does the server make of the checkpoint config and launch args policyc emits?

How SGLang is obtained: `pip download --no-deps` of the sglang 0.5.23 wheel (plus the few small pure runtime
dependencies its config code builds classes on: msgspec, psutil, pybase64, dill) into the one wheel cache
($POLICYC_ORACLE_CACHE, default ~/.cache/policyc-oracles, /wheels: ~39 MB, sglang 38 MB of it), unpacked once and
reused (~200 MB unpacked). Nothing of SGLang is copied into
this repository. The package does not import on a CPU-only box with our dependencies, so its modules are imported in
a sandbox (tests/oracles/_sandbox.py) where absent third-party imports (triton, sgl_kernel, zmq, ...) are inert stubs;
SGLang's own code runs unchanged.

What is asked, per emitted (checkpoint config, launch args, env):
  * `prepare_server_args(argv)` + `ServerArgs.resolve_once()`: SGLang's real argument parser and its resolution /
    validation pipeline (the MoE-runner overrides, the shared-experts-fusion switches, ep/tp checks, the
    quantization-method check against the checkpoint in `ModelConfig._verify_quantization`), on a model directory
    holding exactly the config.json / hf_quant_config.json `policyc convert` writes.
  * `loader._get_quantization_config(model_config, load_config)`: the quant config the loader builds from the
    checkpoint (`from_config`, packed_modules_mapping of the model class, min-capability check).
  * `loader.resolve_shared_experts_config(model_class, hf_config, quant_config)`: whether shared experts are fused
    into the routed-experts FusedMoE (DeepSeek-V2/V3 `num_fused_shared_experts`).
  * `quant_config.get_quant_method(layer, prefix)` for every SGLang module of the model, with `layer` an instance of
    the SGLang layer class that module is built from and `prefix` its SGLang name (fused names from the model
    class's `packed_modules_mapping`, FusedMoE names from `FusedMoE.make_expert_params_mapping`).
  * `runtime_context.moe_tp_size_of(server_args)`: the expert-TP SGLang derives from tp/ep/moe_dp.

Simulated, because the box has no GPU (documented, narrow): the plan's target GPU (SM100 for blackwell, SM90 for
hopper) through SGLang's own `runtime_context.override_platform(...)` facts, plus the two probes that bypass it
(`loader.get_device_capability`, `torch.cuda.get_device_capability` / `_is_cuda` in the model module), and
`--device cuda`. SGLang then resolves as it would on that GPU.

Where SGLang cannot be obtained or loaded, `OracleUnavailable` is raised with the reason (tests fail, never skip).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from unittest import mock

from ._sandbox import Sandbox, env
from ._wheels import download, extract, install_site

SGLANG_VERSION = "0.5.23"
# Small runtime dependencies SGLang's config code subclasses / serializes with (a stub would change behaviour).
REAL_DEPS = ("msgspec==0.23.0", "psutil==7.2.2", "pybase64==1.5.1", "dill==0.4.1")
TARGET_CAPABILITY = {"blackwell": (10, 0), "hopper": (9, 0)}
# SGLang's own platform facts (runtime_context.override_platform) for each target GPU.
TARGET_PLATFORM = {
    "blackwell": dict(is_cuda=True, is_hip=False, is_npu=False, is_musa=False, is_sm90=False, is_sm100=True,
                      is_sm100_or_sm110=True, is_sm110=False, is_sm120=False, is_blackwell=True,
                      is_hopper_with_cuda_12_3=False, device_capability=(10, 0), device_sm=100),
    "hopper": dict(is_cuda=True, is_hip=False, is_npu=False, is_musa=False, is_sm90=True, is_sm100=False,
                   is_sm100_or_sm110=False, is_sm110=False, is_sm120=False, is_blackwell=False,
                   is_hopper_with_cuda_12_3=True, device_capability=(9, 0), device_sm=90),
}


class OracleUnavailable(RuntimeError):
    """SGLang could not be obtained or loaded: the reason, for a failing test."""


class SGLangRefused(Exception):
    """SGLang's own code rejected the launch (argument parser, resolution pipeline, loader checks)."""


def wheel(req: str) -> Path:
    """The wheel of `req` ("name==version") in the one wheel cache (oracles/_wheels.py). Every test reading SGLang
    (this oracle, the model-source tests) takes the sglang wheel from there, so it is downloaded and stored once."""
    return download(req, OracleUnavailable)


def sglang_wheel() -> Path:
    return wheel(f"sglang=={SGLANG_VERSION}")


def fetch_site() -> Path:
    """The unpacked sglang wheel (+ REAL_DEPS), downloaded with pip once and reused."""
    whls = [wheel(req) for req in (f"sglang=={SGLANG_VERSION}",) + REAL_DEPS]

    def fill(tmp: Path) -> None:
        for whl in whls:
            extract(whl, tmp)

    return install_site(f"sglang-{SGLANG_VERSION}-site", fill, json.dumps(sorted(p.name for p in whls)))


# SGLang layer class (module, class name) each of our roles is built from in the SGLang model code
# (models/qwen3_moe.py, models/deepseek_v2.py, models/deepseek_nextn.py of 0.5.23). The quant decision itself is
# SGLang's: get_quant_method is asked with an instance of this class.
_LINEAR = ("sglang.srt.layers.linear", "LinearBase")
LAYER_CLASS = {
    "attn.q": ("sglang.srt.layers.linear", "QKVParallelLinear"),
    "attn.k": ("sglang.srt.layers.linear", "QKVParallelLinear"),
    "attn.v": ("sglang.srt.layers.linear", "QKVParallelLinear"),
    "attn.o": ("sglang.srt.layers.linear", "RowParallelLinear"),
    "attn.q_a": ("sglang.srt.layers.linear", "ReplicatedLinear"),
    "attn.kv_a": ("sglang.srt.layers.linear", "ReplicatedLinear"),
    "attn.q_b": ("sglang.srt.layers.linear", "ColumnParallelLinear"),
    "attn.kv_b": ("sglang.srt.layers.linear", "ColumnParallelLinear"),
    "mlp.gate": ("sglang.srt.layers.linear", "MergedColumnParallelLinear"),
    "mlp.up": ("sglang.srt.layers.linear", "MergedColumnParallelLinear"),
    "mlp.down": ("sglang.srt.layers.linear", "RowParallelLinear"),
    "shared_experts.gate": ("sglang.srt.layers.linear", "MergedColumnParallelLinear"),
    "shared_experts.up": ("sglang.srt.layers.linear", "MergedColumnParallelLinear"),
    "shared_experts.down": ("sglang.srt.layers.linear", "RowParallelLinear"),
    "routed_experts.gate": ("sglang.srt.layers.moe.fused_moe_triton", "FusedMoE"),
    "routed_experts.up": ("sglang.srt.layers.moe.fused_moe_triton", "FusedMoE"),
    "routed_experts.down": ("sglang.srt.layers.moe.fused_moe_triton", "FusedMoE"),
    "lm_head": ("sglang.srt.layers.vocab_parallel_embedding", "ParallelLMHead"),
    "mtp.lm_head": ("sglang.srt.layers.vocab_parallel_embedding", "ParallelLMHead"),
    "mtp.eh_proj": ("torch.nn", "Linear"),  # deepseek_nextn: nn.Linear(2*hidden, hidden)
}
# Routers: DeepSeek `MoEGate` is a plain nn.Module; Qwen3-MoE builds `mlp.gate` as ReplicatedLinear with
# quant_config=None (qwen3_moe.py l.280-296, modelslim only otherwise): never handed to the quant config.
ROUTER_CLASS = {"deepseek_v3": ("sglang.srt.models.deepseek_v2", "MoEGate")}


@dataclass
class Launch:
    """What SGLang resolved for one emitted configuration."""

    argv: list[str]
    resolved: dict  # selected ServerArgs fields after resolve_once()
    moe_tp_size: int
    quant_name: Optional[str]
    packed_modules_mapping: dict
    shared_experts_fused: int  # num_fused_shared_experts
    fusion_disabled_reason: Optional[str]
    hf_overrides: dict = field(default_factory=dict)  # model-config fields after --json-model-override-args
    kinds: dict[str, str] = field(default_factory=dict)  # hf_name -> kind SGLang runs (loaded modules only)
    methods: dict[str, str] = field(default_factory=dict)  # SGLang module prefix -> quant method class
    prefixes: dict[str, str] = field(default_factory=dict)  # hf_name -> the SGLang module prefix that loads it


RESOLVED_FIELDS = ("tp_size", "ep_size", "pp_size", "moe_dp_size", "quantization", "kv_cache_dtype",
                   "moe_runner_backend", "moe_a2a_backend", "disable_shared_experts_fusion", "fp8_gemm_runner_backend",
                   "dtype", "speculative_algorithm", "json_model_override_args")


class SGLangOracle:
    def __init__(self, site: Path):
        self.site = site
        self.sandbox = Sandbox(str(site), ("sglang",))
        models_pkg = __name__.rsplit(".", 1)[0] + ".sglang_models"
        try:
            with self.sandbox, env({"SGLANG_EXTERNAL_MODEL_PACKAGE": models_pkg}):
                import sglang.srt.models.registry  # noqa: F401
                import sglang.srt.configs.load_config  # noqa: F401
                import sglang.srt.layers.quantization  # noqa: F401
                import sglang.srt.model_loader.loader  # noqa: F401
                import sglang.srt.server_args  # noqa: F401
        except Exception as e:  # the reason goes to the failing test
            raise OracleUnavailable(f"SGLang {SGLANG_VERSION} from {site} does not load: {type(e).__name__}: {e}") \
                from e

    # -- one emitted configuration --------------------------------------------------------------------------------
    def launch(self, model_dir: Path, server_args: list[str], env_vars: dict[str, str], arch, target: str) -> Launch:
        """Parse + resolve `server_args` for the checkpoint in `model_dir` and ask every module's quant method."""
        argv = ["--model-path", str(model_dir), "--device", "cuda", *server_args]
        cap = TARGET_CAPABILITY[target]
        with self.sandbox, env(env_vars), ExitStack() as stack:
            from sglang.srt import runtime_context as rc
            from sglang.srt.configs.load_config import LoadConfig
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.model_loader import loader
            from sglang.srt.model_loader.utils import get_model_architecture
            from sglang.srt.server_args import prepare_server_args

            stack.enter_context(rc.override_platform(**TARGET_PLATFORM[target]))
            try:
                sa = prepare_server_args(argv)
                sa.resolve_once()
            except SystemExit as e:  # argparse
                raise SGLangRefused(f"SGLang's argument parser rejects {server_args}: exit {e.code}") from e
            except (ValueError, AssertionError, RuntimeError, TypeError) as e:
                raise SGLangRefused(f"SGLang's server-args resolution rejects {server_args}: "
                                    f"{type(e).__name__}: {e}") from e
            resolved = {f: _plain(getattr(sa, f, None)) for f in RESOLVED_FIELDS}
            ctx = rc.get_context()
            prev = ctx._server_args, ctx._config_bags, ctx.parallel._config
            stack.callback(_restore_context, ctx, prev)
            ctx.set_server_args(sa)
            moe_tp = rc.moe_tp_size_of(sa)
            model_config = ModelConfig.from_server_args(sa)
            model_class, _ = get_model_architecture(model_config)
            stack.enter_context(_simulated_gpu(cap, loader))
            stack.enter_context(_module_cuda(model_class, cap))
            try:
                quant_config = loader._get_quantization_config(model_config, LoadConfig())
            except ValueError as e:
                raise SGLangRefused(f"SGLang's loader rejects the checkpoint quant config: {e}") from e
            packed = _packed_modules_mapping(model_class, model_config.hf_config, quant_config)
            from sglang.srt.layers.moe.utils import resolve_shared_experts_config

            shared = resolve_shared_experts_config(model_class, model_config.hf_config, quant_config)
            reason = None
            gate = getattr(model_class, "shared_experts_fusion_disable_reason", None)
            if gate is not None:
                reason = gate(model_config.hf_config, quant_config)
            launch = Launch(argv=argv, resolved=resolved, moe_tp_size=moe_tp,
                            quant_name=quant_config.get_name() if quant_config is not None else None,
                            packed_modules_mapping=packed, shared_experts_fused=shared.num_fused_shared_experts,
                            fusion_disabled_reason=reason)
            launch.hf_overrides = {k: getattr(model_config.hf_config, k, None) for k in ("router_fp32",)}
            self._ask_modules(launch, arch, quant_config, packed, model_config.hf_config)
        return launch

    def _ask_modules(self, launch: Launch, arch, quant_config, packed: dict, hf_config) -> None:
        import importlib

        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        from sglang.srt.layers.quantization import utils as qutils

        # is_layer_skipped falls back to this table for qkv_proj / gate_up_proj when the model's mapping lacks them
        fused_names = {**getattr(qutils, "_FALLBACK_FUSED_SHARDS", {}), **packed}
        shard_to_fused = {s: fused for fused, shards in fused_names.items() for s in shards}
        num_experts = int(arch.config.get("n_routed_experts") or arch.config.get("num_experts") or 0)
        expert_map = {weight_name: param_name for param_name, weight_name, _, _ in
                      FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)}
        cache: dict[tuple, str] = {}
        for t in arch.tensors:
            if not t.is_linear and t.role != "router.weight":
                continue
            if t.mtp is not None and not launch.resolved.get("speculative_algorithm"):
                continue  # the NextN draft model is loaded only with speculative decoding
            module = t.hf_name.rsplit(".", 1)[0]
            role = t.role
            if role.startswith("shared_experts.") and launch.shared_experts_fused:
                # DeepseekV2WeightLoaderMixin loads `mlp.shared_experts.*` as expert n_routed_experts of the
                # layer's FusedMoE when num_fused_shared_experts > 0.
                prefix, cls_ref = module.split(".shared_experts.")[0] + ".experts", LAYER_CLASS["routed_experts.gate"]
            elif role.startswith("routed_experts."):
                m = re.search(r"experts\.\d+\.[a-z_]+\.", t.hf_name)
                param = expert_map.get(m.group(0)) if m else None
                if param is None:
                    raise AssertionError(f"{t.hf_name}: not in SGLang's FusedMoE expert params mapping")
                # checkpoint `...experts.E.gate_proj.weight` -> parameter `...experts.w13_weight` of module `...experts`
                prefix = t.hf_name.replace(m.group(0), param).rsplit(".", 1)[0]
                cls_ref = LAYER_CLASS[role]
            elif role == "router.weight":
                ref = ROUTER_CLASS.get(arch.model_type)
                if ref is None:  # built with quant_config=None
                    launch.kinds[t.hf_name] = "bf16"
                    continue
                prefix, cls_ref = module, ref
            else:
                parent, _, last = module.rpartition(".")
                prefix = f"{parent}.{shard_to_fused[last]}" if last in shard_to_fused else module
                if t.mtp is not None and t.sglang_prefix:
                    prefix = t.sglang_prefix  # NextN draft model names (model.decoder.*, shared_head.head)
                cls_ref = LAYER_CLASS[role]
            key = (prefix, cls_ref)
            if key not in cache:
                cls = getattr(importlib.import_module(cls_ref[0]), cls_ref[1])
                layer = _bare(cls)
                method = quant_config.get_quant_method(layer, prefix) if quant_config is not None else None
                cache[key] = _method_kind(method, quant_config)
                launch.methods[prefix] = type(method).__name__ if method is not None else "None"
            launch.kinds[t.hf_name] = cache[key]
            launch.prefixes[t.hf_name] = prefix


def _plain(v):
    return v.value if hasattr(v, "value") and not isinstance(v, (int, str, float)) else v


def _restore_context(ctx, prev) -> None:
    ctx._server_args, ctx._config_bags, ctx.parallel._config = prev


@contextmanager
def _simulated_gpu(cap: tuple[int, int], loader):
    import torch

    with mock.patch.object(loader, "get_device_capability", lambda *a, **k: cap), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: cap):
        yield


@contextmanager
def _module_cuda(model_class, cap):
    """The model module's import-time platform probes, as on the target GPU."""
    mod = sys.modules[model_class.__module__]
    names = {n: True for n in ("_is_cuda",) if hasattr(mod, n)}
    names.update({n: False for n in ("_is_hip", "_is_musa", "_is_npu") if hasattr(mod, n)})
    with ExitStack() as stack:
        for n, v in names.items():
            stack.enter_context(mock.patch.object(mod, n, v))
        yield


def _packed_modules_mapping(model_class, hf_config, quant_config) -> dict:
    """The fused-module mapping SGLang gives the quant config: the model class's `packed_modules_mapping`, which
    DeepSeek-V2/V3 completes in `__init__` (q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj_with_mqa when
    q_lora_rank is set). That `__init__` is run up to the point where it needs the distributed runtime."""
    import torch

    mapping = dict(getattr(model_class, "packed_modules_mapping", {}) or {})
    obj = model_class.__new__(model_class)
    torch.nn.Module.__init__(obj)
    try:
        model_class.__init__(obj, config=hf_config, quant_config=None)
    except Exception:  # noqa: BLE001 - stops where the distributed runtime (pp_group, tp ranks) is first needed
        pass
    mapping.update(getattr(obj, "packed_modules_mapping", {}) or {})
    if quant_config is not None and getattr(quant_config, "packed_modules_mapping", None):
        for k, v in mapping.items():
            quant_config.packed_modules_mapping.setdefault(k, v)
        mapping = dict(quant_config.packed_modules_mapping)
    return {k: list(v) for k, v in mapping.items() if isinstance(v, (list, tuple))}


def _bare(cls):
    """An instance of an SGLang layer class without running its constructor (which allocates sharded weights)."""
    import torch

    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    obj.use_triton_kernels = False
    obj.use_flashinfer_trtllm_moe = False
    return obj


def _method_kind(method, quant_config) -> str:
    """The weight format a quant method runs: bf16 (unquantized / no method), mxfp8, fp8_block, nvfp4."""
    if method is None:
        return "bf16"
    name = type(method).__name__
    if name.startswith("Unquantized"):
        return "bf16"
    if name in ("Fp8LinearMethod", "Fp8MoEMethod"):
        if quant_config.use_mxfp8:
            return "mxfp8"
        if quant_config.weight_block_size == [128, 128]:
            return "fp8_block"
        return "fp8"
    if name.startswith("ModelOptFp4") or name.startswith("ModelOptNvFp4"):
        return "nvfp4"
    return f"unknown:{name}"


# ---- policyc side: the checkpoint directory + launch SGLang would get for a plan ----------------------------------
def model_dir_for(plan, arch, root: Path) -> Path:
    """A model directory with the config.json / hf_quant_config.json `policyc convert` writes for `plan` (the
    bundled config.json with the plan's quantization_config; weights are not needed to resolve the config)."""
    from precision_dsl.backends.converter import quantization_files

    src = Path(arch.source) if getattr(arch, "source", None) else None
    config = json.loads((_bundled_dir(plan.model) / "config.json").read_text()) if src is None else \
        json.loads((src / "config.json").read_text())
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


def _bundled_dir(model: str) -> Path:
    import precision_dsl

    return Path(precision_dsl.__file__).parent / "models" / model
