"""policyc's vLLM worker extension for verl 0.9.1: the rollout side of `policyc run --engine verl` for a quantized
plan verl's own rollout.quantization (fp8 / torchao / ascend) cannot serve.

How verl is meant to be extended here: verl starts vLLM with `worker_extension_cls` =
verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension (vllm_async_server.py
vLLMHttpServer._get_worker_extension_cls) and spreads `actor_rollout_ref.rollout.engine_kwargs.vllm` LAST over its own
engine args (vllm_async_server.py launch_server), so `engine_kwargs.vllm.worker_extension_cls` names this class
instead; vLLM mixes it into its worker (vllm/v1/worker/worker_base.py: resolve_obj_by_qualname, appended to the
worker's bases). verl's server then drives every weight sync through the same RPC it uses for its own class,
`update_weights_from_ipc` (bucketed BF16 tensors under HF checkpoint names, verl's BucketedWeightReceiver).

What this class does differently from verl's, and why:
  * `__new__`: verl's applies its ModelOpt-QAT patches when vLLM's quant config is ModelOptNvFp4Config
    (verl/utils/modelopt/vllm_modelopt_patch.py apply_modelopt_nvfp4_patches: Marlin W4A16 kernels and its own
    weight post-processing), which would serve other numerics than the plan's; only verl's process setup (death
    signal, its LoRA hijack, full determinism) is kept, called from verl's own module.
  * `update_weights_from_ipc`: the BF16 tensors verl sends are quantized with the converter's one function
    (backends/quantize.py checkpoint_tensors, vLLM's names: rollout="vllm"), share-scale groups once every member has
    arrived, and loaded with vLLM's `model.load_weights` inside vLLM's layerwise reload
    (vllm/model_executor/model_loader/reload: initialize_layerwise_reload / finalize_layerwise_reload, what vLLM
    0.33's weight-transfer engines run around their loads, vllm/distributed/weight_transfer/nccl_engine.py): the
    same names and bytes as `policyc convert --rollout vllm` and the vLLM live update
    (backends/weight_update/vllm_transport.py).

The plan travels as the emitted policyc_plan.json: its path and content hash in the worker's environment
(POLICYC_VERL_PLAN, POLICYC_VERL_PLAN_HASH, set by the launch in the Ray runtime env). vllm / verl / torch are imported
only when vLLM builds the class (module `__getattr__`), so `policyc` never needs them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from ..backends.quantize import checkpoint_tensors, needs_shared_amax
from ..errors import PolicycError
from ..plan import Plan

if TYPE_CHECKING:
    import torch

ENV_PLAN = "POLICYC_VERL_PLAN"
ENV_PLAN_HASH = "POLICYC_VERL_PLAN_HASH"
EXTENSION = "precision_dsl.engine.verl_worker.PolicycWorkerExtension"
VERL_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
BACKEND = "verl worker"


class VerlWorkerError(PolicycError, RuntimeError):
    """The worker cannot serve the plan's weights exactly: the reason, never a silent approximation."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def load_plan_file(path: Optional[str], want_hash: Optional[str]) -> Plan:
    """The plan the launch was emitted for, checked against the hash the launch carries."""
    if not path:
        raise VerlWorkerError(f"{ENV_PLAN} is not set in the vLLM worker's environment",
                              hint="launch with the emitted launch_verl.sh (it passes the plan in the Ray runtime env)")
    try:
        plan = Plan.from_json(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise VerlWorkerError(f"cannot read the plan {path}: {err}") from None
    if want_hash and plan.content_hash() != want_hash:
        raise VerlWorkerError(f"the plan {path} is {plan.content_hash()}, the launch was emitted for {want_hash}",
                              hint="re-run `policyc run --engine verl` for this plan")
    return plan


class PlanQuantizer:
    """verl's BF16 weight buckets -> the converter's tensors under vLLM's names, as (name, tensor) pairs ready for
    vLLM's `load_weights`. Members of a share-scale group whose NVFP4 global scale is the group's wait until the
    whole group has arrived (verl's buckets may split a group); every other tensor is converted as it arrives."""

    def __init__(self, plan: Plan, kernel: str = "auto"):
        self.plan, self.kernel = plan, kernel
        self.by = plan.by_name()
        self.group_of = {m: g for g in plan.share_scale_groups for m in g.members}
        self.pending: dict[str, dict[str, "torch.Tensor"]] = {}  # group id -> arrived members
        self.received: set[str] = set()

    def feed(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> list[tuple[str, "torch.Tensor"]]:
        out: list[tuple[str, "torch.Tensor"]] = []
        for name, x in weights:
            t = self.by.get(name)
            if t is None:
                raise VerlWorkerError(f"verl sent '{name}', which is not a tensor of the plan's checkpoint "
                                      f"({self.plan.model})", hint="the plan was emitted for another model")
            self.received.add(name)
            g = self.group_of.get(name) if needs_shared_amax(t) else None
            if g is None:
                out += self._convert([(t, x)])
                continue
            got = self.pending.setdefault(g.id, {})
            got[name] = x
            if len(got) == len(g.members):
                del self.pending[g.id]
                out += self._convert([(self.by[m], got[m]) for m in g.members])
        return out

    def _convert(self, members) -> list[tuple[str, "torch.Tensor"]]:
        if all(t.mtp is not None for t, _ in members):
            return []  # vLLM builds no MTP layer without --speculative-config (vllm_transport.VllmNames.unbuilt)
        return list(checkpoint_tensors(members, backend=BACKEND, kernel=self.kernel, rollout="vllm").items())

    def finish(self) -> None:
        """After the last bucket: every served plan tensor arrived and no group is left half-received."""
        half = sorted(m for g in self.plan.share_scale_groups if g.id in self.pending for m in g.members
                      if m not in self.pending[g.id])
        missing = [t.hf_name for t in self.plan.tensors if t.mtp is None and t.hf_name not in self.received]
        if half or missing:
            names = (half or missing)[:3]
            raise VerlWorkerError(f"verl's weight sync did not send {len(half or missing)} tensor(s) of the plan, "
                                  f"e.g. {', '.join(names)}" + (" (a share-scale group is incomplete)" if half else ""),
                                  hint="the rollout keeps the previous weights for them; check the actor's export")


def rollout_pairs(plan: Plan, weights: Iterable[tuple[str, "torch.Tensor"]],
                  kernel: str = "auto") -> list[tuple[str, "torch.Tensor"]]:
    """All of verl's weights at once -> what the extension hands vLLM's loader (the test's entry)."""
    q = PlanQuantizer(plan, kernel)
    out = q.feed(weights)
    q.finish()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the class vLLM mixes into its worker: built on first access, inside the vLLM worker process
# ---------------------------------------------------------------------------------------------------------------
def _build_extension():
    import importlib

    verl_utils = importlib.import_module(VERL_EXTENSION.rsplit(".", 1)[0])
    base = getattr(verl_utils, VERL_EXTENSION.rsplit(".", 1)[1])

    class PolicycWorkerExtension(base):
        """verl's colocate worker extension with policyc's weight sync (module docstring)."""

        def __new__(cls, **kwargs):
            # verl's own process setup (vLLMColocateWorkerExtension.__new__), without its ModelOpt-QAT patches
            verl_utils.set_death_signal()
            if os.environ.get("VERL_FULL_DETERMINISM", "0") == "1" and os.environ.get("VERL_SEED") is not None:
                from verl.workers.engine.utils import enable_full_determinism

                enable_full_determinism(seed=int(os.environ["VERL_SEED"]))
            verl_utils.VLLMHijack.hijack()
            transfer = getattr(kwargs.get("vllm_config"), "weight_transfer_config", None)
            if getattr(transfer, "backend", None) == "verl_delta_ipc":
                raise VerlWorkerError("verl's delta weight sync sends BF16 deltas, not the plan's formats",
                                      hint="leave actor_rollout_ref.rollout.checkpoint_engine at verl's default")
            instance = super(base, cls).__new__(cls)
            instance._is_qat_model = instance._is_modelopt_qat = False
            instance._policyc_plan = load_plan_file(os.environ.get(ENV_PLAN), os.environ.get(ENV_PLAN_HASH))
            return instance

        def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
            """verl's sync RPC: receive verl's BF16 buckets, load the plan's bytes through vLLM's layerwise reload."""
            import torch
            from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                  initialize_layerwise_reload)

            from verl.utils.device import get_device_name
            from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

            if peft_config:
                raise VerlWorkerError("a LoRA adapter sync has no precision plan",
                                      hint="train without LoRA for a policyc plan")
            if self.device is None:
                self.device = torch.device(f"{get_device_name()}:{self.local_rank}")
            model = self.model_runner.model
            quantizer = PlanQuantizer(self._policyc_plan)
            initialize_layerwise_reload(model)
            receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)

            def on_bucket(weights, is_last):
                pairs = quantizer.feed(weights)
                if pairs:
                    model.load_weights(pairs)

            try:
                receiver.receive_weights(on_bucket_received=on_bucket)
            finally:
                finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
            quantizer.finish()

    PolicycWorkerExtension.__module__ = __name__
    PolicycWorkerExtension.__qualname__ = "PolicycWorkerExtension"
    return PolicycWorkerExtension


_BUILT: dict = {}


def __getattr__(name: str):
    if name == "PolicycWorkerExtension":
        if name not in _BUILT:
            _BUILT[name] = _build_extension()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
