"""The engine's seam to the live weight-update path (trainer -> rollout), with the plan-hash check.

Sender side: quantize every tensor per the *sender's* plan (qlinear.quantize_weights: the same function the trainer's
forward uses, honouring share-scale groups) and pack the stored bytes (data / scale / global_scale, or BF16) into
one safetensors blob whose metadata carries the plan's content hash and each tensor's format.
Receiver side: check the hash against its own plan BEFORE touching any buffer, then unpack to QuantizedTensors.

When `backends.weight_update` (WeightSender / WeightReceiver) is importable it is used instead; this module then
only adapts its API. The blob is plain bytes, so a cross-process transport only needs to move it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..plan import Plan


class PlanHashMismatch(RuntimeError):
    pass


@dataclass
class Payload:
    blob: bytes
    plan_hash: str
    version: int

    @property
    def nbytes(self) -> int:
        return len(self.blob)


class InProcessSender:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.plan_hash = plan.content_hash()
        self.version = 0

    def pack(self, weights: dict[str, torch.Tensor]) -> Payload:
        from safetensors.torch import save

        from .qlinear import quantize_weights

        q = quantize_weights(self.plan, weights)
        flat: dict[str, torch.Tensor] = {}
        formats: dict[str, dict] = {}
        for name, v in q.items():
            if isinstance(v, torch.Tensor):
                flat[name] = v.contiguous()
            else:
                for part, t in v.tensors().items():
                    flat[f"{name}::{part}"] = t.contiguous()
                formats[name] = {"fmt": v.fmt.model_dump(mode="json"), "shape": list(v.shape), "axis": v.axis}
        self.version += 1
        meta = {"plan_hash": self.plan_hash, "version": str(self.version), "formats": json.dumps(formats)}
        return Payload(blob=save(flat, metadata=meta), plan_hash=self.plan_hash, version=self.version)


class InProcessReceiver:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.plan_hash = plan.content_hash()

    def unpack(self, payload: Payload) -> dict[str, object]:
        """hf_name -> QuantizedTensor or BF16 tensor. Raises PlanHashMismatch before decoding anything."""
        from safetensors.torch import load

        from ..formats.base import QuantizedTensor
        from ..precision import TensorFormat

        if payload.plan_hash != self.plan_hash:
            raise PlanHashMismatch(f"weight update refused: sender plan {payload.plan_hash[:19]}... != receiver plan "
                                   f"{self.plan_hash[:19]}... (trainer and rollout were built from different "
                                   "policies; hint: `policyc diff` the two plans)")
        flat = load(payload.blob)
        # the blob's own metadata must agree with the envelope (a stale or spliced blob is refused too)
        header_len = int.from_bytes(payload.blob[:8], "little")
        header = json.loads(payload.blob[8: 8 + header_len])
        meta = header.get("__metadata__", {})
        if meta.get("plan_hash") != self.plan_hash:
            raise PlanHashMismatch("weight update refused: blob metadata carries a different plan hash")
        formats = json.loads(meta.get("formats", "{}"))
        out: dict[str, object] = {}
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in flat.items():
            if "::" in key:
                name, part = key.split("::", 1)
                parts.setdefault(name, {})[part] = t
            else:
                out[key] = t
        for name, ps in parts.items():
            f = formats[name]
            out[name] = QuantizedTensor(fmt=TensorFormat.model_validate(f["fmt"]), shape=tuple(f["shape"]),
                                        data=ps["data"], scale=ps.get("scale"), global_scale=ps.get("global_scale"),
                                        axis=f["axis"])
        return out


def make_channel(sender_plan: Plan, receiver_plan: Plan):
    """(sender, receiver) pair. The sender quantizes with `sender_plan`; the receiver checks `receiver_plan`."""
    return InProcessSender(sender_plan), InProcessReceiver(receiver_plan)
