"""vLLM's own weight loader, on CPU: the receiving end of a live weight update, judged by what vLLM's params hold.

`build(model_dir, engine_args, target)` builds the vLLM model class for a checkpoint config + engine args exactly as
the oracle does (tests/oracles/vllm_oracle.py: vLLM 0.33.0's `initialize_model` inside its own config and parallel
state), but on the CPU with real (small) tensors in the model dtype instead of the meta device, so that its
`load_weights` - the function vLLM's weight-transfer engines hand every received (name, tensor) pair to
(vllm/distributed/weight_transfer/nccl_engine.py `NCCLWeightTransferEngine.receive_weights`) - runs for real: the
model's stacked_params_mapping (qkv_proj, gate_up_proj, fused_qkv_a_proj), the RoutedExperts expert params mapping
(experts.E.gate_proj -> w13 shard w1, up_proj -> w3, down_proj -> w2) and every parameter's own weight_loader.

Parameters are read back as `load_weights` leaves them: the checkpoint format. A live update in vLLM 0.33 runs inside
a layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py: `initialize_layerwise_reload` restores the
checkpoint-format parameters recorded when the model was built, then `load_weights`), so a freshly built model is the
state the received tensors are loaded into; the conversion into kernel format (`process_weights_after_loading`) that
follows is vLLM's and is not run here.

Simulated (the CPU has no GPU kernel; narrow): a quant method picks its GEMM / MoE kernel while it is constructed or
creates its weights (`init_*_linear_kernel`, `select_*_moe_backend`). Where that choice raises on the CPU, the MoE
backend named by the engine args (`--moe-backend`, vLLM's own map_*_backend) is taken, or an inert kernel for a
linear; the parameters the method registers - names, dtypes, shapes, weight loaders - are vLLM's.

`receive(update_info, channel)`: vLLM's NCCL engine itself receives an update - `parse_update_info` (vLLM's check of
the message: {names, dtype_names, shapes}) and `receive_weights` - with its NCCL communicator replaced by an
in-process channel that hands over the tensors the trainer broadcast, in order.

`expected_params` / `mismatches`: every vLLM parameter must hold exactly the checkpoint bytes routed to it, stacked as
vLLM's fused modules stack their shards (dim 0, packed order), experts as w13 = [gate; up] and w2 = down, per-shard
scalar scales (NVFP4 weight_scale_2 / input_scale) as the last axis [gate, up]; vocab rows past the checkpoint's are
padding. A parameter with no checkpoint tensor routed to it, or a byte that differs, is a mismatch.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional
from unittest import mock

from ._sandbox import env
from .vllm_oracle import VllmRefused, _capability, _in_process_registry, oracle

VERSION = "0.33.0"
SENTINEL = 0x5A  # every parameter byte before loading: a byte left unwritten reads back as 0x5A


class _NoKernel:
    """The GEMM kernel a CPU cannot have (never called: only weights are loaded here)."""

    def input_quant_key(self):
        """What vllm/model_executor/layers/fusion/quant_activation.py expose_input_quant_key reads while the method
        creates its weights: no pre-quantized input."""
        return None

    def process_weights_after_loading(self, layer) -> None:
        raise AssertionError("kernel-format processing is not run in the loader test")


def _moe_backend(enum, choice: str, mapper):
    if choice and choice != "auto":
        try:
            return mapper(choice)
        except (ValueError, KeyError):
            pass
    return next(iter(enum))


def _kernel_free(stack: ExitStack) -> None:
    """The kernel choices of the quant methods that raise on a CPU: the engine args' MoE backend, an inert linear
    kernel (see the module docstring). vLLM's choice is kept wherever it does not raise."""
    import importlib

    fp8 = importlib.import_module("vllm.model_executor.layers.quantization.fp8")
    modelopt = importlib.import_module("vllm.model_executor.layers.quantization.modelopt")
    o_fp8 = importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.fp8")
    o_nvfp4 = importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.nvfp4")
    o_mxfp8 = importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.mxfp8")
    o_bf16 = importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.unquantized")
    bf16 = importlib.import_module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method")

    def linear(orig):
        def choose(*args, **kwargs):
            try:
                return orig(*args, **kwargs)
            except (ValueError, RuntimeError, NotImplementedError, AssertionError):
                return _NoKernel()
        return choose

    def moe(orig, enum, mapper):
        def choose(*args, **kwargs):
            try:
                return orig(*args, **kwargs)
            except (ValueError, RuntimeError, NotImplementedError, AssertionError):
                config = kwargs.get("config", kwargs.get("moe_config", args[0] if args else None))
                return _moe_backend(enum, getattr(config, "moe_backend", "auto"), mapper), None
        return choose

    for mod in (fp8, modelopt):
        for name in ("init_fp8_linear_kernel", "init_mxfp8_linear_kernel", "init_nvfp4_linear_kernel"):
            if hasattr(mod, name):
                stack.enter_context(mock.patch.object(mod, name, linear(getattr(mod, name))))
    mxfp8_map = getattr(o_mxfp8, "_BACKEND_NAME_MAP", {}).__getitem__
    for mod in (fp8, modelopt, bf16):
        for name, enum, mapper in (("select_unquantized_moe_backend", o_bf16.UnquantizedMoeBackend,
                                    o_bf16.map_unquantized_backend),
                                   ("select_fp8_moe_backend", o_fp8.Fp8MoeBackend, o_fp8.map_fp8_backend),
                                   ("select_nvfp4_moe_backend", o_nvfp4.NvFp4MoeBackend, o_nvfp4.map_nvfp4_backend),
                                   ("select_mxfp8_moe_backend", o_fp8.Fp8MoeBackend, mxfp8_map)):
            if hasattr(mod, name):
                stack.enter_context(mock.patch.object(mod, name, moe(getattr(mod, name), enum, mapper)))


class _Channel:
    """The in-process stand-in of vLLM's NCCL communicator: `broadcast(tensor, src, stream)` fills the receiver's
    tensor with the next tensor the sender put in (what an NCCL broadcast from rank 0 does)."""

    def __init__(self, tensors):
        self._it = iter(tensors)

    def broadcast(self, tensor, src=0, stream=None):
        import torch

        sent = next(self._it)
        if sent.dtype != tensor.dtype or tuple(sent.shape) != tuple(tensor.shape):
            raise AssertionError(f"broadcast of {sent.dtype} {tuple(sent.shape)} into {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")
        with torch.no_grad():
            tensor.copy_(sent)


@dataclass
class VllmModel:
    """A vLLM model class built on the CPU (see the module docstring); every call runs inside vLLM's sandbox."""

    model: object
    vllm_config: object
    loaded: set = field(default_factory=set)

    @contextmanager
    def _inside(self):
        o = oracle(VERSION)
        with o.sandbox, env(o._env()), ExitStack() as stack:
            from vllm.config import set_current_vllm_config

            stack.enter_context(set_current_vllm_config(self.vllm_config))
            yield

    def params(self) -> dict:
        return dict(self.model.named_parameters())

    def load_weights(self, pairs: Iterable) -> set:
        """The model's own `load_weights` (the names it reports as loaded)."""
        import torch

        with self._inside(), torch.no_grad():
            got = self.model.load_weights(list(pairs))
        self.loaded |= set(got or ())
        return set(got or ())

    def receive(self, update_info: dict, tensors: list) -> None:
        """vLLM's NCCLWeightTransferEngine receives one `update_weights` message whose tensors arrive through the
        in-process channel (the NCCL broadcast's stand-in), in `names` order."""
        import torch

        with self._inside(), torch.no_grad():
            from vllm.config.weight_transfer import WeightTransferConfig
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            engine = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), self.vllm_config,
                                              torch.device("cpu"), self.model)
            engine.model_update_group = _Channel(tensors)
            info = engine.parse_update_info(update_info)  # raises on a message vLLM does not accept
            orig = self.model.load_weights

            def load_weights(weights):
                got = orig(weights)
                self.loaded |= set(got or ())
                return got

            # receive_weights passes torch.cuda.current_stream() to the broadcast: there is no CUDA stream here
            with mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: None), \
                    mock.patch.object(self.model, "load_weights", load_weights):
                engine.receive_weights(info)


def build(model_dir, engine_args: list[str], target: Optional[str] = "blackwell", dtype: str = "bfloat16") \
        -> VllmModel:
    """The vLLM model for the checkpoint config in `model_dir` and `engine_args`, on the CPU, every parameter byte
    set to SENTINEL. `dtype`: the model dtype a GPU server takes from config.json (`--dtype auto`)."""
    import torch

    o = oracle(VERSION)
    with o.sandbox, env(o._env()), _in_process_registry(), _capability(target), ExitStack() as stack:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        vc = o._engine_config(o._argv(model_dir, list(engine_args) + ["--dtype", dtype]))
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            setattr(vc.parallel_config, name, 1)
        vc.parallel_config.world_size = 1
        stack.enter_context(set_current_vllm_config(vc))
        o._init_parallel()
        _kernel_free(stack)
        try:
            with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vc)
        except Exception as e:  # noqa: BLE001
            raise VllmRefused(f"vLLM's model build rejects the config: {type(e).__name__}: {e}") from e
        with torch.no_grad():
            for p in model.parameters():
                p.data.reshape(-1).view(torch.uint8).fill_(SENTINEL)
        return VllmModel(model=model, vllm_config=vc)


def model_dir(root: Path, config: dict, quantization_config: Optional[dict] = None) -> Path:
    """A config-only checkpoint directory (vLLM builds the model from config.json alone)."""
    config = dict(config)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


# ---- the expectation: which checkpoint bytes each vLLM parameter must hold -------------------------------------------
_EXPERT_SHARDS = {"w13_": ("gate_proj", "up_proj"), "w2_": ("down_proj",)}
_PER_SHARD_SCALARS = ("weight_scale_2", "input_scale")  # one fp32 value per shard: stacked on the last axis
# Attention KV-cache scales (vllm/model_executor/layers/quantization/kv_cache.py BaseKVCacheMethod.create_weights,
# a ModelOpt / fp8 checkpoint's attention layers): the converter writes none and the emitted engine args serve a
# bfloat16 KV cache, so they are not part of the update and are not compared.
KV_CACHE_SCALES = ("attn.q_scale", "attn.k_scale", "attn.v_scale", "attn.prob_scale")


def _expected_expert(prefix: str, rest: str, ckpt: dict, n_experts: int):
    """`...mlp.experts.routed_experts.w13_weight_scale` <- experts.E.{gate,up}_proj.weight_scale for every E."""
    import torch

    for head, shards in _EXPERT_SHARDS.items():
        if not rest.startswith(head):
            continue
        suffix = rest[len(head):]
        per_expert = []
        for e in range(n_experts):
            parts = [ckpt.get(f"{prefix}.{e}.{s}.{suffix}") for s in shards]
            if any(p is None for p in parts):
                return None
            if suffix in _PER_SHARD_SCALARS:
                per_expert.append(torch.stack([p.reshape(()) for p in parts]) if len(parts) > 1
                                  else parts[0].reshape(()))
            else:
                per_expert.append(torch.cat(parts, 0))
        return torch.stack(per_expert)
    return None


def expected_params(vm: VllmModel, ckpt: dict) -> dict:
    """{vLLM param name: the tensor it must hold (None: no checkpoint tensor is routed to it)}."""
    import torch

    packed = {k: list(v) for k, v in (getattr(vm.model, "packed_modules_mapping", None) or {}).items()}
    out = {}
    for name, p in vm.params().items():
        mod, _, suffix = name.rpartition(".")
        parent, _, last = mod.rpartition(".")
        want = None
        if ".experts.routed_experts." in name:
            experts_prefix = name.split(".routed_experts.")[0]
            want = _expected_expert(experts_prefix, name.split(".routed_experts.")[1], ckpt, p.shape[0])
        elif name in ckpt:
            want = ckpt[name]
        elif last in packed:
            parts = [ckpt.get(f"{parent}.{s}.{suffix}") for s in packed[last]]
            if all(x is not None for x in parts):
                if suffix in _PER_SHARD_SCALARS:
                    want = torch.stack([x.reshape(()) for x in parts])
                else:
                    want = torch.cat(parts, 0)
        out[name] = want
    return out


def _bytes(x):
    import torch

    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def mismatches(vm: VllmModel, ckpt: dict) -> list[str]:
    """Every vLLM parameter against the checkpoint bytes routed to it (see the module docstring); [] = all equal."""
    import torch

    bad = []
    for name, want in expected_params(vm, ckpt).items():
        if name.endswith(KV_CACHE_SCALES) and want is None:
            continue
        got = vm.params()[name].data
        if want is None:
            bad.append(f"{name}: no checkpoint tensor reaches it")
            continue
        if want.dtype != got.dtype:
            bad.append(f"{name}: vLLM holds {got.dtype}, the checkpoint tensor is {want.dtype}")
            continue
        if tuple(want.shape) != tuple(got.shape):
            vocab = want.dim() == got.dim() and want.shape[1:] == got.shape[1:] and want.shape[0] < got.shape[0]
            if not vocab:
                bad.append(f"{name}: vLLM holds {tuple(got.shape)}, the checkpoint tensor is {tuple(want.shape)}")
                continue
            got = got[:want.shape[0]]  # padded vocab rows (VocabParallelEmbedding / ParallelLMHead)
        if not torch.equal(_bytes(got), _bytes(want)):
            n = int((_bytes(got) != _bytes(want)).sum())
            bad.append(f"{name}: {n} byte(s) differ")
    return bad
