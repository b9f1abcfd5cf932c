"""The engine's seam to the live weight-update path (precision_dsl.backends.weight_update), trainer -> rollout.

Sender side (trainer): `LiveUpdateChannel.send(weights)` hands BF16(master) weights to `WeightSender`, which quantizes
them with the converter's own function (precision_dsl.backends.quantize.checkpoint_tensors: share-scale groups together), packs
them into buckets and ships them over a fresh `InProcessTransport`, with a sha256 per tensor (Miles'
--check-weight-update-equal). Receiver side (rollout): `receive(payload, plan)` runs `WeightReceiver`, which checks
the plan content hash in the handshake BEFORE any tensor is read (precision_dsl.backends.common.PlanMismatch) and verifies the
digests, and returns {hf_name: QuantizedTensor | BF16 tensor}.

CUDA weights take the GPU update program (backends/update_program.py: segments of grouped launches, no per-tensor
Python, every bucket byte fingerprinted on the GPU and checked by the receiver): the channel keeps a BF16 copy of the
masters that it refreshes in place each update (one multi-tensor copy, as Megatron's optimizer refreshes its BF16
params from the FP32 main params) and binds the program to it once.

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
        self.device_path = True  # CUDA weights: quantize and pack on the GPU (see _send); False after a failure there
        self.device_path_error: str | None = None
        # the GPU update program: (names, BF16 shadow tensors, sender, binding); False = not available here
        self._program: tuple | bool | None = None

    def send(self, weights: dict[str, torch.Tensor]) -> Payload:
        self.version += 1
        if self.device_path and any(w.is_cuda for w in weights.values()):
            try:
                return self._send(weights, on_gpu=True)
            except _device_path_errors() as e:  # retried on the host path below, which decides
                # The host path (the reference, checked by the whole test suite) either sends the same update, so
                # the device path was at fault: say so and keep using the host path; or it fails too: its error
                # (a real contract violation such as non-finite weights) is the one raised.
                payload = self._send(weights, on_gpu=False)
                self.device_path = False
                self._program = None
                self.device_path_error = f"{type(e).__name__}: {str(e)[:300]}"
                import sys

                print(f"policyc: device weight-update path failed ({self.device_path_error}); using the host path",
                      file=sys.stderr, flush=True)
                return payload
        return self._send(weights, on_gpu=False)

    def _send_program(self, weights: dict[str, torch.Tensor]) -> Payload | None:
        """The update through the GPU update program, bound once to this channel's BF16 copy of the masters; None
        when the program cannot run here (no Triton kernels): the caller takes the per-unit path."""
        from .. import kernels

        if self._program is False or not kernels.available():
            self._program = False  # decided once: not retried (and the model not quantized twice) every update
            return None
        names = tuple(weights)
        prog = self._program
        if prog is None or prog[0] != names:
            shadow = [w.detach().to(torch.bfloat16) for w in weights.values()]
            if any(s.data_ptr() == w.data_ptr() for s, w in zip(shadow, weights.values())):
                shadow = [s.clone() for s in shadow]  # BF16 masters: a copy, never an alias the optimizer moves
            # every byte fingerprinted: the loop's byte check covers the quantized weights only, this covers the rest
            sender = WeightSender(self.plan, InProcessTransport(), bucket_bytes=self.bucket_bytes, check_equal=True,
                                  gpu_program=True)
            prog = self._program = (names, shadow, sender, sender.prepare_program(list(zip(names, shadow))))
        else:
            torch._foreach_copy_(prog[1], [w.detach() for w in weights.values()])  # fp32 -> bf16, RN, in place
        _, _, sender, bound = prog
        transport = InProcessTransport()  # this update's own: nothing of it can be read as another update
        report = sender.over(transport).send(bound, weight_version=f"v{self.version}")
        return Payload(transport=transport, plan_hash=report.plan_hash, version=self.version, nbytes=report.bytes,
                       buckets=report.buckets)

    def _send(self, weights: dict[str, torch.Tensor], on_gpu: bool) -> Payload:
        if on_gpu:
            payload = self._send_program(weights)
            if payload is not None:
                return payload
        transport = InProcessTransport()
        # on_gpu: CUDA weights stay on the GPU and take the sender's per-unit path there (the converter's
        # quantization with the fused kernels, buckets packed on the device with their on-device checksums) instead
        # of moving the model to the host and quantizing it with the CPU reference (seconds per step at 300M
        # parameters; same bytes, tests/test_kernels.py). Not the GPU update program: it binds the sender's tensors
        # once and expects them updated in place, while the trainer's BF16 weights are fresh copies of the fp32
        # masters each step. No per-tensor sha256 on the host either: the loop compares every quantized weight of
        # trainer and rollout byte for byte after each update (check_weight_bytes), which checks the same thing.
        sender = WeightSender(self.plan, transport, bucket_bytes=self.bucket_bytes, check_equal=not on_gpu,
                              gpu_program=False)
        items = ((n, w.detach().to(torch.bfloat16) if on_gpu else w.detach().to(torch.bfloat16).cpu())
                 for n, w in weights.items())
        report = sender.send(items, weight_version=f"v{self.version}")
        return Payload(transport=transport, plan_hash=report.plan_hash, version=self.version, nbytes=report.bytes,
                       buckets=report.buckets)


def _device_path_errors() -> tuple[type[BaseException], ...]:
    """What the device path may fail with that the host path can still answer: CUDA / torch runtime errors (OOM
    included), I/O, a kernel that cannot run here, Triton's compile and resource errors. Programming errors
    (NameError, AttributeError, TypeError, ...) are not in it: they surface instead of hiding behind the host path."""
    from ..kernels import KernelUnavailable

    errors: tuple[type[BaseException], ...] = (RuntimeError, OSError, ImportError, KernelUnavailable)
    try:
        from triton.errors import TritonError
    except ImportError:
        return errors
    return errors + (TritonError,)


def receive(payload: Payload, plan: Plan) -> dict[str, object]:
    """{hf_name: QuantizedTensor | Tensor}. Raises backends.common.PlanMismatch when the sender's plan differs."""
    return WeightReceiver(plan, payload.transport, check_equal=True).receive(timeout=60)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's stored bytes as a flat uint8 view (dtype views and scalar-vs-[1] shapes compare equal)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality regardless of dtype views (uint8 vs float8) and scalar-vs-[1] shapes."""
    if a.device != b.device:  # compare where both live: no host copy of two GPU models per step
        a, b = a.cpu(), b.cpu()
    a, b = _bytes(a), _bytes(b)
    return a.numel() == b.numel() and torch.equal(a, b)


def differing(pairs, chunk_bytes: int = 256 << 20) -> list[int]:
    """Indices of the (a, b) tensor pairs whose bytes differ, `same_bytes` for many pairs at once. Pairs on one GPU
    are compared there in a few passes: both sides' bytes concatenated per chunk of about `chunk_bytes` (one launch
    each, so the check never holds more than ~2 x chunk_bytes of copies) and compared with one host sync per chunk
    (a per-pair torch.equal is one sync each, ~300 per weight update of a small MoE; a per-pair comparison kernel
    still two launches each). Only in a chunk that differs are the pairs compared one by one, to name them."""
    out, pending = [], {}
    for i, (a, b) in enumerate(pairs):
        if a.device != b.device or not a.is_cuda:
            if not same_bytes(a, b):
                out.append(i)
            continue
        a, b = _bytes(a), _bytes(b)
        if a.numel() != b.numel():
            out.append(i)
        else:
            pending.setdefault(a.device, []).append((i, a, b))
    for group in pending.values():
        chunks, cur, size = [], [], 0
        for item in group:
            cur.append(item)
            size += item[1].numel()
            if size >= chunk_bytes:
                chunks, cur, size = chunks + [cur], [], 0
        for chunk in chunks + ([cur] if cur else []):
            if torch.equal(torch.cat([a for _, a, _ in chunk]), torch.cat([b for _, _, b in chunk])):
                continue
            flags = torch.stack([(a != b).any() for _, a, b in chunk]).tolist()
            out += [i for (i, _, _), bad in zip(chunk, flags) if bad]
    return sorted(out)
