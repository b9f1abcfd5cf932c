"""The rollout engine: a SEPARATE model instance that only ever sees weights from the weight-update path.

Like an SGLang server it (1) receives bucketed quantized bytes (precision_dsl.backends.weight_update) after a plan-hash
handshake that refuses a mismatching plan, (2)
dequantizes them into its own buffers (its parameters start as NaN, so a missed update cannot go unnoticed), and
(3) samples with a KV cache, quantizing GEMM inputs exactly as its plan says (per-token NVFP4, MXFP8 1x32, ...).
The received QuantizedTensors are kept (`received`) so tests can assert byte equality with the trainer's.

Numerics (`numerics=`): "independent" (default) computes like an inference server, with its own quantizers and
GEMMs over the received bytes and a bf16 model (rollout_gemm.py), so trainer-rollout agreement is measured, not
built in; "mirror" reuses the trainer's reference quantizers and fp32 GEMM (isolates contract violations: with a
consistent contract the mismatch is then ~1e-6 by construction).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..plan import Plan
from . import numerics
from .model import Qwen3MoeConfig, Qwen3MoeForCausalLM
from .sampling import SampleBatch, sample
from .weight_path import LiveUpdateChannel, Payload, receive


class Rollout(Protocol):
    """What the RL loop needs from a rollout engine, wherever it runs: in this process (LocalRollout) or in its own
    process on another device (remote.RemoteRollout). Weights reach it only through `channel` (the live
    weight-update path) and `update_weights`; `received` holds the quantized weights it got, for the byte check."""

    channel: object  # .send(named trainer weights) -> the payload `update_weights` takes
    received: dict

    def update_weights(self, payload) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int, pad_id: int,
                 generator: torch.Generator, temperature: float = 1.0) -> SampleBatch: ...

    def close(self) -> None: ...

    def gemm_report(self) -> dict[str, int]:
        """GEMM calls per path so far ({} where the engine does not count them, e.g. in another process)."""
        ...


class RolloutExecutor:
    """GEMM with the received (already dequantized) weight and plan-quantized activations. No autograd."""

    def __init__(self, plan: Plan, model: Qwen3MoeForCausalLM, etp: int = 1):
        by = plan.by_name()
        self.act = {n: by[n].precision.activation for n in model.linear_names()}
        # expert-TP emulation of activation scales (see qlinear.linear_specs): row-parallel expert down_proj
        self.parts = {n: etp if by[n].role == "routed_experts.down" else 1 for n in model.linear_names()}
        self.paths: dict[str, int] = {}  # fp32 GEMMs of the mirror numerics: not counted by path

    def __call__(self, hf_name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xq = numerics.fake_quantize_partitioned(x.to(torch.bfloat16), self.act[hf_name], self.parts[hf_name],
                                                what=hf_name)
        return xq @ w.t()


NUMERICS = ("independent", "mirror")


class RolloutEngine:
    def __init__(self, cfg: Qwen3MoeConfig, plan: Plan, device: str = "cpu", etp: int = 1,
                 numerics: str = "independent"):
        if numerics not in NUMERICS:
            raise ValueError(f"rollout numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.plan = plan
        self.numerics = numerics
        dtype = torch.bfloat16 if numerics == "independent" else torch.float32
        self.model = Qwen3MoeForCausalLM(cfg, init=False).to(device=device, dtype=dtype).requires_grad_(False).eval()
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))
        if numerics == "independent":
            from .rollout_gemm import IndependentRolloutExecutor

            self.model.linear_executor = IndependentRolloutExecutor(plan, self.model.linear_names(), etp)
        else:
            self.model.linear_executor = RolloutExecutor(plan, self.model, etp)
        self.received: dict[str, object] = {}
        self.version = 0
        self.device = device

    def gemm_report(self) -> dict[str, int]:
        return dict(sorted(self.model.linear_executor.paths.items()))

    @torch.no_grad()
    def update_weights(self, payload: Payload) -> None:
        tensors = receive(payload, self.plan)  # plan hash checked in the handshake, before any tensor is read
        self.load_received(tensors, payload.version)

    @torch.no_grad()
    def load_received(self, tensors: dict, version: int) -> None:
        """Dequantize received {hf_name: QuantizedTensor | Tensor} into this engine's buffers (also used by the
        out-of-process rollout in remote.py, whose tensors arrive over torch.distributed)."""
        params = dict(self.model.named_parameters())
        unknown = set(tensors) - set(params)
        if unknown:
            raise KeyError(f"weight update carries unknown tensor {sorted(unknown)[0]}")
        independent = self.numerics == "independent"
        linear = set(self.model.linear_names()) if independent else set()
        for name, v in tensors.items():
            if not isinstance(v, torch.Tensor):
                self.received[name] = v
            if name in linear:  # the GEMM reads its operand from the received bytes, not from the parameter
                self.model.linear_executor.load(name, v, self.device)
            elif isinstance(v, torch.Tensor):
                params[name].copy_(v.to(params[name].dtype))
            else:
                params[name].copy_(numerics.dequantize(v, torch.float32))
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int, pad_id: int,
                 generator: torch.Generator, temperature: float = 1.0) -> SampleBatch:
        if self.version == 0:
            raise RuntimeError("rollout engine has no weights yet (call update_weights first)")
        from .routing import RoutingRecorder

        recorder = RoutingRecorder()
        self.model.routing = recorder  # every MoE layer's top-k, for routing replay (R3) in the trainer
        try:
            batch = sample(self.model, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                           generator=generator, temperature=temperature)
        finally:
            self.model.routing = None
        batch.routing = recorder.result()
        return batch


class LocalRollout(RolloutEngine):
    """The rollout engine in the trainer's process: weights still travel through the weight-update path (packed,
    hash-checked), in memory."""

    def __init__(self, cfg: Qwen3MoeConfig, plan: Plan, device: str = "cpu", etp: int = 1,
                 numerics: str = "independent"):
        super().__init__(cfg, plan, device=device, etp=etp, numerics=numerics)
        self.channel = LiveUpdateChannel(plan)

    def close(self) -> None:
        pass
