"""vLLM, asked directly: which quant method does vLLM give every module of a model, for a checkpoint + engine args?

How vLLM is obtained: `pip download --no-deps` of the vllm wheel into the oracle cache ($POLICYC_ORACLE_CACHE,
default ~/.cache/policyc-oracles; the 0.33.0 wheel is 336 MB, 0.24.0 279 MB), of which only the Python sources are
unpacked (56 MB / 35 MB of .py and .json; the compiled kernels, the rust router and the vendored CUDA headers stay
in the wheel), once, and reused. Nothing of vLLM is copied into this repository. vLLM does not import on a CPU-only box with our
dependencies, so its modules are imported in a sandbox (tests/oracles/_sandbox.py) where the absent third-party
modules it imports unconditionally (servers, tokenizer grammars, serialisers: STUBS) are inert stubs. Only those:
every other absent package (flashinfer, deep_gemm, triton_kernels, zentorch, ...) stays absent, so vLLM's own
`find_spec` / `try: import` probes of optional kernels answer as on a box without them. vLLM's code runs unchanged.

What is asked, per (model dir, engine args), with VLLM_TARGET_DEVICE=cpu and HF_HUB_OFFLINE=1:
  * `parse_engine_args`: vLLM's real serve parser (`vllm/entrypoints/common/cli_args.py:make_arg_parser`; 0.24.0:
    `vllm/entrypoints/openai/cli_args.py`, which
    adds `AsyncEngineArgs.add_cli_args`), `AsyncEngineArgs.from_cli_args` and `create_engine_config()` - the
    checkpoint's config.json `quantization_config` / hf_quant_config.json, `--quantization`,
    `--quantization-config` (online), `--hf-overrides`, the parallel sizes, all checked by vLLM itself.
  * `vllm_modules`: the model vLLM builds for that config (`model_loader/utils.py:initialize_model`, on the meta
    device, inside vLLM's own parallel state initialised with gloo at world size 1): every module's `quant_method`,
    which each layer's constructor got from `resolve_quant_method` -> `quant_config.get_quant_method(layer,
    prefix)` with `layer` the real vLLM layer (QKVParallelLinear, GateLinear, RoutedExperts, ParallelLMHead...) and
    `prefix` vLLM's own module name.

Simulated, because the box has no GPU (documented, narrow):
  * The plan's target GPU capability (SM100 for blackwell, SM90 for hopper; `target=None`: the CPU's own answer,
    none) as vLLM's platform reports it (`Platform.get_device_capability`, which `has_device_capability` /
    `is_device_capability_family` and the quantization min-capability check read); the platform stays vLLM's CPU
    platform otherwise.
  * vLLM 0.24.0 knows it runs on a CPU only from a `+cpu` package version; its CPU platform is selected by
    reporting that version while vLLM is first imported (`_cpu_platform`).
  * The model registry inspects a model class in a subprocess only so as not to initialise CUDA
    (`vllm/model_executor/models/registry.py:_run_in_subprocess`); here it runs in-process.
  * Tensor / pipeline / data parallel sizes are checked by `create_engine_config` as given, but the model is built
    at world size 1 (get_quant_method does not depend on the rank; the shapes would).
  * vLLM picks the GEMM / MoE kernel for a quant method when it builds the method or its weights
    (`select_*_moe_backend`, `init_*_linear_kernel`). There is no GPU kernel on a CPU: where that choice raises, the
    method vLLM had chosen (the class whose constructor / create_weights raised) and its weight / activation
    QuantKeys (read from the method, or from the frames that chose the kernel) are recorded with the kernel error
    (`ModuleQuant.kernel_error`), and the layer gets an inert stand-in of that class so the build goes on. The
    decision which method a module gets is vLLM's; only the kernel is missing.

Where vLLM cannot be obtained or loaded, `OracleUnavailable` is raised with the reason (tests fail, never skip).
"""

from __future__ import annotations

import functools
import importlib
import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from unittest import mock

from ._sandbox import Sandbox, env
from ._wheels import cache_dir, download, extract, install_site

VLLM_VERSIONS = ("0.33.0", "0.24.0")
# Absent modules vLLM imports unconditionally on the way to its config, model and quantization code (servers,
# metrics, serialisers, structured-output grammars, tool parsers). None of them is read by what is asked here.
STUBS = {
    "0.33.0": ("aiohttp", "cachetools", "cbor2", "compressed_tensors", "einops", "fastapi", "llguidance", "msgspec",
               "openai", "openai_harmony", "partial_json_parser", "prometheus_client", "psutil", "pybase64", "uvloop",
               "xgrammar", "zmq"),
}
STUBS["0.24.0"] = STUBS["0.33.0"]
PLATFORM_FROM_TARGET_DEVICE = ("0.33.0",)  # versions that read VLLM_TARGET_DEVICE (see _cpu_platform)
# Where `vllm serve`'s parser (make_arg_parser) lives.
SERVE_PARSER = {"0.33.0": "vllm.entrypoints.common.cli_args", "0.24.0": "vllm.entrypoints.openai.cli_args"}
TARGET_CAPABILITY = {"blackwell": (10, 0), "hopper": (9, 0)}
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "VLLM_DO_NOT_TRACK": "1", "VLLM_CONFIGURE_LOGGING": "0"}


class OracleUnavailable(RuntimeError):
    """vLLM could not be obtained or loaded: the reason, for a failing test."""


class VllmRefused(Exception):
    """vLLM's own code rejected the engine args or the checkpoint config: its message."""


@dataclass
class ModuleQuant:
    """What vLLM runs for one module it builds (key of `vllm_modules`: vLLM's quant prefix of the module)."""

    method: str  # vLLM class name of the quant method (UnquantizedLinearMethod, ModelOptLinearMethod, ...)
    weight: str  # policyc TensorFormat.short() of the weight it implies ("bf16", "mxfp8/e4m3[1x32]", ...)
    activation: str  # its activation scheme ("bf16", "nvfp4 static per-tensor", "nvfp4 per-token", ...)
    shards: list[str]  # HF module names it covers (fused q/k/v, gate/up, every expert's gate/up/down)
    layer: str = ""  # vLLM layer class (QKVParallelLinear, GateLinear, RoutedExperts, ParallelLMHead, ...)
    formats: dict[str, str] = field(default_factory=dict)  # HF shard name -> weight format (MoE: w13 vs w2)
    kernel_error: Optional[str] = None  # the CPU has no kernel for it (see the module docstring)
    params: list[str] = field(default_factory=list)  # the parameters the layer registered (weight, weight_scale, ...)


def _check_version(version: str) -> None:
    if version not in VLLM_VERSIONS:
        raise OracleUnavailable(f"vLLM {version} is not an oracle version (known: {', '.join(VLLM_VERSIONS)})")


def fetch_site(version: str) -> Path:
    """The unpacked Python sources of the vllm wheel, downloaded with pip once and reused."""
    _check_version(version)
    whl = download(f"vllm=={version}", OracleUnavailable)
    keep = (lambda n: n.startswith("vllm/") and n.endswith((".py", ".json"))  # noqa: E731
            and "/third_party/" not in n.replace("third_party/pynvml", ""))
    return install_site(f"vllm-{version}-site", lambda tmp: extract(whl, tmp, keep), json.dumps([whl.name]))


# ---- QuantKey -> policyc vocabulary --------------------------------------------------------------------------------
def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def _group(gs) -> tuple[int, int]:
    return (int(gs.row), int(gs.col))


def weight_format(key, fused: bool) -> str:
    """policyc format short string of a weight stored per vLLM's QuantKey `key` (None: high precision, bf16)."""
    if key is None:
        return "bf16"
    if isinstance(key, _Unknown):
        return f"unknown:{key.method}"
    d, s = _dtype(key.dtype), key.scale
    g, sd = _group(s.group_shape), _dtype(s.dtype)
    if d == "uint8" and sd == "float8_e4m3fn" and g == (1, 16) and key.scale2 is not None:
        # NVFP4: one FP32 weight_scale_2 per shard, of which vLLM takes the max over fused shards
        # (modelopt.py KNvfp4Static.process; gate/up of an expert share w13_weight_scale_2[:, 0]).
        return "nvfp4[1x16,shared]" if fused else "nvfp4[1x16,per_tensor]"
    if d == "float8_e4m3fn" and sd == "uint8" and g == (1, 32):
        return "mxfp8/e4m3[1x32]"
    if d == "float8_e4m3fn" and sd == "float32" and g == (-1, -1):
        return "fp8/e4m3"
    if d == "float8_e4m3fn" and g[0] > 0 and g[1] > 0:
        return f"fp8_block/e4m3[{g[0]}x{g[1]},{'fp32' if sd == 'float32' else sd.replace('float8_e8m0fnu', 'e8m0')}]"
    return f"vllm:{key}"


def activation_format(key, experts: bool = False) -> str:
    """The activation scheme of vLLM's QuantKey `key` (None: not quantized, bf16)."""
    if key is None:
        return "bf16"
    if isinstance(key, _Unknown):
        return f"unknown:{key.method}"
    d, s = _dtype(key.dtype), key.scale
    g, sd = _group(s.group_shape), _dtype(s.dtype)
    mode = "static" if s.static else "dynamic"
    if d == "uint8" and sd == "float8_e4m3fn" and g == (1, 16) and key.scale2 is not None:
        s2 = key.scale2
        if not s2.static and _group(s2.group_shape) == (1, -1):
            return "nvfp4 per-token"
        # a static FP32 global input scale: per shard for a linear (max over fused shards), per expert for MoE
        return "nvfp4 static per-expert" if experts else "nvfp4 static per-tensor"
    if d == "float8_e4m3fn" and sd == "uint8" and g == (1, 32):
        return f"mxfp8 {mode}"
    if d == "float8_e4m3fn":
        gran = {(-1, -1): "per-tensor", (1, -1): "per-token"}.get(g, f"{g[0]}x{g[1]}")
        return f"fp8 {gran} {mode}" if gran[0].isdigit() else f"fp8 {mode} {gran}"
    return f"vllm:{key}"


# Quant-method classes that hold no QuantKey (vLLM 0.24.0's per-format ModelOpt classes): the keys their
# create_weights / apply implement, by vLLM's own constant names (vllm/model_executor/layers/quantization/utils/
# quant_utils.py). Read only where neither the method nor the frames that built it give a key.
CLASS_KEYS = {
    "ModelOptNvFp4LinearMethod": ("kNvfp4Static", "kNvfp4Dynamic"),
    "ModelOptNvFp4W4A16LinearMethod": ("kNvfp4Static", None),
    "ModelOptMxFp8LinearMethod": ("kMxfp8Static", "kMxfp8Dynamic"),
    "ModelOptMxFp8FusedMoE": ("kMxfp8Static", "kMxfp8Dynamic"),
    "ModelOptFp8LinearMethod": ("kFp8StaticTensorSym", "kFp8StaticTensorSym"),
    "ModelOptFp8PcPtLinearMethod": ("kFp8StaticChannelSym", "kFp8DynamicTokenSym"),
}
_KEY_NAMES = {"weight": ("weight_quant_key", "weight_key"), "activation": ("activation_quant_key", "activation_key")}


def _keys_of_method(method) -> dict:
    """weight / activation QuantKeys a constructed quant method holds (ModelOpt: `.spec`; fp8 / online: attrs)."""
    out = {}
    spec = getattr(method, "spec", None)
    if spec is not None and hasattr(spec, "weight"):
        out["weight"], out["activation"] = spec.weight, getattr(spec, "activation", None)
    for role, names in _KEY_NAMES.items():
        for n in names:
            if role not in out and n in getattr(method, "__dict__", {}):
                out[role] = method.__dict__[n]
    return out


class _KeyTrace:
    """While a quant method is chosen / creates its weights: the QuantKeys vLLM's own frames hold when they return
    (a method constructor's locals, the arguments of the kernel / MoE-backend selection), and the outermost
    quant-method constructor that raised."""

    def __init__(self, site: str, key_cls, method_base):
        self.site, self.key_cls, self.method_base = site, key_cls, method_base
        self.keys: dict = {}
        self.raised_in = None  # class of the method whose __init__ raised

    def __call__(self, frame, event, arg):
        if event != "return" or not frame.f_code.co_filename.startswith(self.site):
            return
        loc = frame.f_locals
        for role, names in _KEY_NAMES.items():
            for n in names:
                v = loc.get(n, _MISSING)
                if v is None or isinstance(v, self.key_cls):
                    self.keys[role] = v
        if frame.f_code.co_name == "__init__" and isinstance(loc.get("self"), self.method_base):
            self.cls = type(loc["self"])

    def run(self, fn, *args, **kwargs):
        self.cls = None
        prev = sys.getprofile()
        sys.setprofile(self)
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.raised_in = self.cls
            raise
        finally:
            sys.setprofile(prev)


_MISSING = object()


class VllmOracle:
    def __init__(self, site: Path, version: str):
        self.site, self.version = site, version
        self.sandbox = Sandbox(str(site), ("vllm",), STUBS[version])
        self._dist_dir = Path(tempfile.mkdtemp(prefix="policyc-vllm-dist-"))
        self._dist_uses = 0
        try:
            with self.sandbox, env(self._env()), _cpu_platform(version):
                import vllm.engine.arg_utils  # noqa: F401
                importlib.import_module(SERVE_PARSER[version])
                import vllm.model_executor.layers.quantization  # noqa: F401
                import vllm.model_executor.model_loader.utils  # noqa: F401
                import vllm.model_executor.models.registry  # noqa: F401
        except Exception as e:  # the reason goes to the failing test
            raise OracleUnavailable(f"vLLM {version} from {site} does not load on this CPU box: "
                                    f"{type(e).__name__}: {e}") from e
        self._dist_ready = False

    def _env(self) -> dict[str, str]:
        return {**ENV, "VLLM_CACHE_ROOT": str(cache_dir() / f"vllm-{self.version}-cache")}

    # -- the engine's argument parsing and config creation ---------------------------------------------------------
    def _engine_config(self, argv: list[str]):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        make_arg_parser = importlib.import_module(SERVE_PARSER[self.version]).make_arg_parser
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        try:
            ns = parser.parse_args(argv)
        except SystemExit as e:  # argparse prints its message to stderr
            raise VllmRefused(f"vLLM's argument parser rejects {argv}: exit {e.code}") from e
        except Exception as e:  # noqa: BLE001 - e.g. --quantization-config validation at parse time
            raise VllmRefused(f"vLLM's argument parser rejects {argv}: {type(e).__name__}: {e}") from e
        try:
            return AsyncEngineArgs.from_cli_args(ns).create_engine_config()
        except Exception as e:  # noqa: BLE001 - pydantic ValidationError / ValueError text is vLLM's own
            raise VllmRefused(f"vLLM's engine config rejects {argv}: {type(e).__name__}: {e}") from e

    def _argv(self, model_dir, engine_args: list[str]) -> list[str]:
        # the model is given as --model (serve's positional also works); no tokenizer exists in a config-only dir
        return ["--model", str(model_dir), "--skip-tokenizer-init", "--load-format", "dummy", *engine_args]

    def parse_engine_args(self, argv: list[str], target: Optional[str] = "blackwell"):
        """vLLM's VllmConfig for the `vllm serve` argv (which names the model with --model or positionally)."""
        with self.sandbox, env(self._env()), _in_process_registry(), _capability(target):
            return self._engine_config(list(argv))

    # -- the model vLLM builds ------------------------------------------------------------------------------------
    def modules(self, model_dir, engine_args: list[str], target: Optional[str] = "blackwell") \
            -> dict[str, ModuleQuant]:
        with self.sandbox, env(self._env()), _in_process_registry(), _capability(target), ExitStack() as stack:
            import torch
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
            from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey
            from vllm.model_executor.model_loader.utils import initialize_model

            vc = self._engine_config(self._argv(model_dir, engine_args))
            for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
                setattr(vc.parallel_config, name, 1)  # built at world size 1 (see the module docstring)
            vc.parallel_config.world_size = 1
            stack.enter_context(set_current_vllm_config(vc))
            stack.callback(self._teardown_parallel)
            self._init_parallel()
            rec = _Recorder(str(self.site), QuantKey, QuantizeMethodBase)
            for qc in _quant_configs(vc.quant_config):
                stack.enter_context(mock.patch.object(qc, "get_quant_method", rec.wrap(qc.get_quant_method)))
            from vllm.model_executor.layers.fused_moe import RoutedExperts

            fallback = rec.wrap_moe_fallback(RoutedExperts._get_quant_method)
            stack.enter_context(mock.patch.object(RoutedExperts, "_get_quant_method",
                                                  lambda self, *a: fallback(self, *a)))
            try:
                with torch.device("meta"):
                    model = initialize_model(vllm_config=vc)
            except Exception as e:  # noqa: BLE001
                raise VllmRefused(f"vLLM's model build rejects the config: {type(e).__name__}: {e}") from e
            return _read_modules(model, rec)

    def _init_parallel(self) -> None:
        from vllm.distributed import parallel_state as ps

        if self._dist_ready and ps.model_parallel_is_initialized():
            return
        init = self._dist_dir / f"init-{self._dist_uses}"  # a fresh rendezvous file per build (file:// store)
        self._dist_uses += 1
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"file://{init}")
        ps.initialize_model_parallel(1, 1)
        self._dist_ready = True

    def _teardown_parallel(self) -> None:
        """Leave no process group behind: the rest of the test session (the engine's own torch.distributed tests)
        must find torch.distributed uninitialised."""
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps

        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._dist_ready = False


@contextmanager
def _cpu_platform(version: str):
    """vLLM's own CpuPlatform as the platform it resolves (once, when `vllm` is first imported). 0.33.0 picks it
    from VLLM_TARGET_DEVICE=cpu; 0.24.0 only where the installed package's version names a CPU build (`+cpu`,
    vllm/platforms/__init__.py: cpu_platform_plugin -> vllm_version_matches_substr): its sources are the same, so
    while it is first imported its package version reads as that of the CPU build."""
    if version in PLATFORM_FROM_TARGET_DEVICE:
        yield
        return
    import importlib.metadata as md

    real = md.version
    with mock.patch.object(md, "version", lambda name: f"{version}+cpu" if name == "vllm" else real(name)):
        yield


class _Recorder:
    """Wraps a quant config's get_quant_method: vLLM's decision per (layer, prefix), and kernel-less methods made
    inert so that the model build goes on."""

    def __init__(self, site, key_cls, method_base):
        self.site, self.key_cls, self.method_base = site, key_cls, method_base
        self.prefix: dict[int, str] = {}  # id(layer) -> quant prefix vLLM asked with
        self.decided: dict[int, dict] = {}  # id(method) -> {"keys", "kernel_error", "method"}

    def wrap(self, orig):
        def get_quant_method(layer, prefix):
            trace = _KeyTrace(self.site, self.key_cls, self.method_base)
            self.prefix[id(layer)] = prefix
            try:
                method = trace.run(orig, layer, prefix)
            except Exception as e:  # noqa: BLE001
                if trace.raised_in is None:
                    raise
                method = _inert(trace.raised_in)
                self._note(method, trace.keys, f"{type(e).__name__}: {e}", trace.raised_in.__name__)
                return method
            if method is not None:
                self._note(method, {**trace.keys, **_keys_of_method(method)}, None, type(method).__name__)
                self._tolerate_create_weights(method)
            return method

        return get_quant_method

    def wrap_moe_fallback(self, orig):
        """RoutedExperts._get_quant_method: where the quant config gives a MoE layer no method, vLLM builds
        UnquantizedFusedMoEMethod itself, whose constructor picks the kernel (a kernel error on a CPU, as above)."""

        def _get_quant_method(layer, prefix, quant_config, moe_config):
            trace = _KeyTrace(self.site, self.key_cls, self.method_base)
            try:
                return trace.run(orig, layer, prefix, quant_config, moe_config)
            except Exception as e:  # noqa: BLE001
                if trace.raised_in is None:
                    raise
                method = _inert(trace.raised_in)
                self._note(method, trace.keys, f"{type(e).__name__}: {e}", trace.raised_in.__name__)
                return method

        return _get_quant_method

    def _note(self, method, keys, error, name) -> None:
        self.decided[id(method)] = {"keys": dict(keys), "kernel_error": error, "method": name, "obj": method}

    def _tolerate_create_weights(self, method) -> None:
        orig = method.create_weights
        note = self.decided[id(method)]

        def create_weights(*args, **kwargs):
            trace = _KeyTrace(self.site, self.key_cls, self.method_base)
            try:
                return trace.run(orig, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - kernel selection on a CPU (see the module docstring)
                note["kernel_error"] = f"{type(e).__name__}: {e}"
                return None
            finally:
                for role, k in trace.keys.items():
                    note["keys"].setdefault(role, k)

        method.create_weights = create_weights


def _inert(cls):
    """An instance of quant-method class `cls` (isinstance checks see it) that creates and processes nothing."""
    noop = lambda self, *a, **k: None  # noqa: E731
    # a MoE method rounds its sizes up for the kernel it chose; with no kernel the sizes stay as they are
    same_sizes = lambda self, hidden, inter, *a, **k: (hidden, inter)  # noqa: E731
    import torch

    # a method that is also a torch Module (a CustomOp) needs the Module's own state to be assigned to
    init = (lambda self, *a, **k: torch.nn.Module.__init__(self)) if issubclass(cls, torch.nn.Module) else noop
    stand_in = type(cls.__name__, (cls,), {"__init__": init, "create_weights": noop,
                                           "process_weights_after_loading": noop, "maybe_roundup_sizes": same_sizes,
                                           "__module__": cls.__module__})
    return stand_in()


class _in_process_registry:
    """vLLM inspects a model class in a subprocess to keep CUDA uninitialised in the parent; on a CPU it runs here."""

    def __enter__(self):
        from vllm.model_executor.models import registry

        self._p = mock.patch.object(registry, "_run_in_subprocess", lambda fn: fn())
        self._p.start()

    def __exit__(self, *exc):
        self._p.stop()
        return False


@contextmanager
def _capability(target: Optional[str]):
    """vLLM's platform reports the target GPU's compute capability (None: the CPU platform's own, no capability)."""
    if target is None:
        yield
        return
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    if target not in TARGET_CAPABILITY:
        raise ValueError(f"unknown target {target!r} (known: {', '.join(TARGET_CAPABILITY)})")
    cap = DeviceCapability(*TARGET_CAPABILITY[target])
    with mock.patch.object(type(current_platform), "get_device_capability",
                           classmethod(lambda cls, device_id=0: cap)):
        yield


def _quant_configs(qc) -> list:
    out = []
    if qc is not None:
        out.append(qc)
        online = getattr(qc, "online_quantization_config", None)
        if online is not None and online is not qc:
            out.append(online)
    return out


def _read_modules(model, rec: _Recorder) -> dict[str, ModuleQuant]:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    out: dict[str, ModuleQuant] = {}
    import torch

    for name, mod in model.named_modules():
        # a plain torch Linear gets no quant method (vLLM 0.24.0's GLM-4.5 router: glm4_moe.py, an fp32 nn.Linear)
        if not isinstance(mod, (LinearBase, RoutedExperts, VocabParallelEmbedding, torch.nn.Linear)):
            continue
        method = getattr(mod, "quant_method", None)
        experts = isinstance(mod, RoutedExperts)
        # unasked modules (no quant config) keep vLLM's name; RoutedExperts is asked as its layer_name `...experts`
        prefix = rec.prefix.get(id(mod), getattr(mod, "layer_name", name) if experts else name)
        note = rec.decided.get(id(method)) if method is not None else None
        keys = note["keys"] if note else {}
        if experts:
            # the layer's own mapping (0.33); 0.24.0 has it on the model only (same entries for every layer)
            mapping = mod.get_expert_mapping() if hasattr(mod, "get_expert_mapping") else model.get_expert_mapping()
            shards, fused = _expert_shards(prefix, mapping), None
        else:
            parent, _, last = prefix.rpartition(".")
            fused = packed.get(last)
            shards = [f"{parent}.{s}" if parent else s for s in fused] if fused else [prefix]
        keys = _complete_keys(keys, note["method"] if note else type(method).__name__)
        w = keys.get("weight")
        if experts:
            formats = {s: weight_format(w, fused=not s.endswith("down_proj")) for s in shards}
            weight = weight_format(w, fused=True)
        else:
            weight = weight_format(w, fused=bool(fused) and len(fused) > 1)
            formats = {s: weight for s in shards}
        out[prefix] = ModuleQuant(method=note["method"] if note else type(method).__name__, weight=weight,
                                  activation=activation_format(keys.get("activation"), experts), shards=shards,
                                  layer=type(mod).__name__, formats=formats,
                                  kernel_error=note["kernel_error"] if note else None,
                                  params=sorted(n for n, _ in mod.named_parameters(recurse=False)))
    return out


def _complete_keys(keys: dict, method: str) -> dict:
    """The recorded keys, completed from CLASS_KEYS; a quantized method whose keys are unknown is reported as
    unknown (never as bf16)."""
    from vllm.model_executor.layers.quantization.utils import quant_utils

    keys = dict(keys)
    if method in CLASS_KEYS:
        for role, name in zip(("weight", "activation"), CLASS_KEYS[method]):
            keys.setdefault(role, None if name is None else getattr(quant_utils, name))
    if not method.startswith("Unquantized") and method != "NoneType":
        for role in ("weight", "activation"):
            if role not in keys:
                keys[role] = _Unknown(method)
    return keys


class _Unknown:
    def __init__(self, method: str):
        self.method = method


def _expert_shards(prefix: str, expert_map) -> list[str]:
    """HF names of the experts a RoutedExperts covers, from its own `get_expert_mapping()` ((param_name,
    weight_name, expert_id, shard_id), weight_name like `experts.3.up_proj.`, under the parent of `...experts`)."""
    parent = prefix.rsplit(".", 1)[0]
    names = []
    for _param, weight_name, _e, _shard in expert_map:
        names.append(f"{parent}.{weight_name.rstrip('.')}")
    return sorted(set(names), key=lambda n: (_expert_index(n), n))


def _expert_index(name: str) -> int:
    part = name.rsplit(".", 2)[-2]
    return int(part) if part.isdigit() else -1


# ---- the API the tests use ----------------------------------------------------------------------------------------
# One vLLM per process: its import registers process-global torch types and ops (torch.library, e.g.
# vllm/utils/torch_utils.py: register_opaque_type(LayerName)), which a second vLLM version cannot register again.
# The primary version (VLLM_VERSIONS[0]) is loaded here; any other is asked in a worker process of its own.
_LOADED: list[str] = []
_WORKERS: dict[str, "_Worker"] = {}
_REPLY = "@@policyc-vllm-oracle@@ "


@functools.lru_cache(maxsize=None)
def oracle(version: str) -> VllmOracle:
    """vLLM `version` itself, loaded in this process (OracleUnavailable with the reason where it cannot be)."""
    _check_version(version)
    if _LOADED and _LOADED[0] != version:
        raise OracleUnavailable(f"vLLM {_LOADED[0]} is loaded in this process; vLLM {version} is asked in a worker "
                                f"process (vllm_modules / parse_engine_args do that)")
    o = VllmOracle(fetch_site(version), version)
    _LOADED.append(version)
    return o


def _local(version: str) -> bool:
    """Whether `version` is asked in this process: the one loaded here, or, before any is, only the primary release
    (VLLM_VERSIONS[0]: the one tests also build models from in-process, tests/oracles/vllm_loader.py), so the order
    in which test modules ask does not decide which vLLM the process holds."""
    if _LOADED:
        return _LOADED[0] == version
    return version == VLLM_VERSIONS[0]


def parse_engine_args(version: str, argv: list[str], target: Optional[str] = "blackwell"):
    """vLLM's real serve parser + `AsyncEngineArgs.from_cli_args(...).create_engine_config()` on a local model dir
    (HF_HUB_OFFLINE=1, VLLM_TARGET_DEVICE=cpu): the VllmConfig (from a worker process: its fields as nested
    namespaces), or VllmRefused with the engine's own error text."""
    _check_version(version)
    if _local(version):
        return oracle(version).parse_engine_args(list(argv), target)
    return _namespace(_worker(version).ask("parse", argv=list(argv), target=target))


def vllm_modules(version: str, model_dir, engine_args: list[str], target: Optional[str] = "blackwell") \
        -> dict[str, ModuleQuant]:
    """vLLM's quant prefix -> ModuleQuant for every linear / MoE / embedding / lm_head module vLLM builds for the
    checkpoint config in `model_dir` with `engine_args`, as on the `target` GPU (VllmRefused with vLLM's text
    where it refuses)."""
    _check_version(version)
    if _local(version):
        return oracle(version).modules(model_dir, list(engine_args), target)
    reply = _worker(version).ask("modules", model_dir=str(model_dir), engine_args=list(engine_args), target=target)
    return {k: ModuleQuant(**v) for k, v in reply.items()}


class _Worker:
    def __init__(self, version: str):
        import atexit

        self.version = version
        self.log = tempfile.TemporaryFile(mode="w+")
        tests = str(Path(__file__).resolve().parents[1])
        code = f"import sys; sys.path.insert(0, {tests!r}); from oracles.vllm_oracle import _serve; _serve({version!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        atexit.register(self.close)

    def ask(self, op: str, **kwargs):
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith(_REPLY):
                    reply = json.loads(line[len(_REPLY):])
                    break
            else:
                raise EOFError("the worker exited")
        except (OSError, EOFError, ValueError) as e:
            self.log.seek(0)
            raise OracleUnavailable(f"the vLLM {self.version} worker process failed ({e}): "
                                    f"{self.log.read()[-2000:]}") from e
        kind = reply.pop("kind")
        if kind == "refused":
            raise VllmRefused(reply["message"])
        if kind == "unavailable":
            raise OracleUnavailable(reply["message"])
        return reply["value"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _worker(version: str) -> _Worker:
    w = _WORKERS.get(version)
    if w is None or w.proc.poll() is not None:
        w = _WORKERS[version] = _Worker(version)
    return w


def _serve(version: str) -> None:
    """Worker process: answers the JSON requests on stdin, one reply line each on stdout."""
    from dataclasses import asdict

    oracle(version)  # this process holds `version` (so vllm_modules / parse_engine_args answer here)

    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "modules":
                mods = vllm_modules(version, req["model_dir"], req["engine_args"], req["target"])
                reply = {"kind": "ok", "value": {k: asdict(v) for k, v in mods.items()}}
            else:
                reply = {"kind": "ok", "value": _plain(parse_engine_args(version, req["argv"], req["target"]))}
        except VllmRefused as e:
            reply = {"kind": "refused", "message": str(e)}
        except OracleUnavailable as e:
            reply = {"kind": "unavailable", "message": str(e)}
        except Exception as e:  # noqa: BLE001 - the parent reports it
            reply = {"kind": "unavailable", "message": f"{type(e).__name__}: {e}"}
        out.write(_REPLY + json.dumps(reply) + "\n")
        out.flush()


def _plain(obj, depth: int = 0):
    """A VllmConfig's fields as JSON (two levels: vllm_config.<config>.<field>), values not JSON-able as str."""
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, (list, tuple)):
        return [_plain(v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v, depth + 1) for k, v in obj.items()}
    fields = getattr(obj, "__dataclass_fields__", None)
    if fields is not None and depth < 2:
        return {"__fields__": {n: _plain(getattr(obj, n, None), depth + 1) for n in fields}}
    return str(obj)


def _namespace(value):
    from types import SimpleNamespace

    if isinstance(value, dict) and "__fields__" in value:
        return SimpleNamespace(**{k: _namespace(v) for k, v in value["__fields__"].items()})
    if isinstance(value, dict):
        return {k: _namespace(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_namespace(v) for v in value]
    return value
