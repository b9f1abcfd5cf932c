"""The engine's seam to the live weight-update path (precision_dsl.backends.weight_update), trainer -> rollout.

Sender side (trainer): `LiveUpdateChannel.send(weights)` hands BF16(master) weights to `WeightSender`, which quantizes
them with the converter's own function (precision_dsl.backends.quantize.checkpoint_tensors: share-scale groups together), packs
them into buckets and ships them over a fresh `InProcessTransport`, with a sha256 per tensor (Miles'
--check-weight-update-equal). Receiver side (rollout): `receive(payload, plan)` runs `WeightReceiver`, which checks
the plan content hash in the handshake BEFORE any tensor is read (precision_dsl.backends.common.PlanMismatch) and verifies the
digests, and returns {hf_name: QuantizedTensor | BF16 tensor}.

Each update gets its own transport, so a refused update leaves nothing queued for the next one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.weight_update import InProcessTransport, WeightReceiver, WeightSender
from ..plan import Plan


@dataclass
class Payload:
    transport: object  # precision_dsl.backends.weight_update.InProcessTransport holding this update's messages
    plan_hash: str  # what the sender announced
    version: int
    nbytes: int  # quantized bytes on the wire (data + scales)
    buckets: int


class LiveUpdateChannel:
    def __init__(self, plan: Plan, bucket_bytes: int = 64 << 20):
        self.plan = plan
        self.bucket_bytes = bucket_bytes
        self.version = 0

    def send(self, weights: dict[str, torch.Tensor]) -> Payload:
        transport = InProcessTransport()
        self.version += 1
        sender = WeightSender(self.plan, transport, bucket_bytes=self.bucket_bytes, check_equal=True)
        # CUDA weights stay on the GPU: the sender then runs its GPU update program (fused quantize kernels into
        # bucket buffers, on-GPU fingerprints) instead of moving the model to the host and quantizing it with the
        # CPU reference + sha256 (seconds per step at 300M parameters; the bytes are the same, tests/test_weight_update*)
        items = ((n, w.detach().to(torch.bfloat16)) for n, w in weights.items())
        report = sender.send(items, weight_version=f"v{self.version}")
        return Payload(transport=transport, plan_hash=report.plan_hash, version=self.version, nbytes=report.bytes,
                       buckets=report.buckets)


def receive(payload: Payload, plan: Plan) -> dict[str, object]:
    """{hf_name: QuantizedTensor | Tensor}. Raises backends.common.PlanMismatch when the sender's plan differs."""
    return WeightReceiver(plan, payload.transport, check_equal=True).receive(timeout=60)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality regardless of dtype views (uint8 vs float8) and scalar-vs-[1] shapes."""
    a, b = a.detach(), b.detach()
    if a.device != b.device:  # compare where both live: no host copy of two GPU models per step
        a, b = a.cpu(), b.cpu()
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return a.numel() * a.element_size() == b.numel() * b.element_size() and torch.equal(a.view(torch.uint8),
                                                                                        b.view(torch.uint8))
