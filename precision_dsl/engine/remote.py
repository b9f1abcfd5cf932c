"""The rollout engine in its own process (and device): trainer on rank 0, rollout on rank 1 of a 2-rank
torch.distributed group — NCCL between two GPUs (`policyc run --device cuda --rollout-device cuda:1`), gloo on CPU.

The embedded loop (loop.py) talks to a rollout through three things: `channel.send(weights) -> Payload`,
`update_weights(payload)`, and `generate(prompts, ...)`, plus `received` (the quantized tensors the rollout holds,
for the byte-identity check). `RemoteRollout` implements exactly those over the process group:

* weights travel through the weight-update path of `precision_dsl.backends.weight_update` — `WeightSender` on the trainer,
  `WeightReceiver` on the rollout, over `TorchDistributedTransport` (a broadcast from rank 0; NCCL on GPUs). Both
  sides run the plan-hash handshake before any tensor moves, and the receiver checks a sha256 per tensor
  (check_equal), so a received byte that differs from what was sent aborts the run.
* `generate` ships the prompts and the sampler's CPU generator state to the worker and takes the batch and the new
  generator state back, so a seeded run draws the same random numbers as the in-process engine.
* `received` fetches the rollout's quantized tensors back (on request, for `--check-weight-bytes`), so the loop's
  trainer-vs-rollout byte comparison runs unchanged.

Control messages use `broadcast_object_list` between our own two processes (trusted, never user data).
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..backends.weight_update import TorchDistributedTransport, WeightReceiver, WeightSender
from ..plan import Plan
from .model import Qwen3MoeConfig
from .rollout import RolloutEngine
from .sampling import SampleBatch
from ..errors import PolicycError


class RemoteRolloutError(PolicycError, RuntimeError):
    pass


@dataclass
class RemotePayload:
    """What `channel.send` returns for a remote rollout (mirrors weight_path.Payload)."""

    plan_hash: str
    version: int
    nbytes: int
    buckets: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _init_group(rank: int, port: int, device: str) -> None:
    # NVLink multicast stays off (shared hosts: see the device notes); harmless elsewhere.
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    kw = {}
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        kw["device_id"] = torch.device(device)
    dist.init_process_group(_backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            **kw)


def _bcast(obj=None, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _to_cpu(batch: SampleBatch) -> SampleBatch:
    return SampleBatch(tokens=batch.tokens.cpu(), attention_mask=batch.attention_mask.cpu(),
                       response_mask=batch.response_mask.cpu(), logprobs=batch.logprobs.cpu(),
                       prompt_len=batch.prompt_len,
                       routing={k: v.cpu() for k, v in batch.routing.items()} if batch.routing else None)


def _q_to_cpu(v):
    if isinstance(v, torch.Tensor):
        return v.cpu()
    for f in ("data", "scale", "global_scale", "global_amax"):
        t = getattr(v, f, None)
        if t is not None:
            setattr(v, f, t.cpu())
    return v


def rollout_worker(model_dir: str, plan_json: str, device: str, port: int, etp: int = 1,
                   numerics: str = "independent") -> None:
    """Rank 1: a RolloutEngine that only ever receives weights from the process group."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    _init_group(1, port, device)
    plan = Plan.from_json(plan_json)
    engine = RolloutEngine(Qwen3MoeConfig.from_file(Path(model_dir) / "config.json"), plan, device=device, etp=etp,
                           numerics=numerics)
    generator = torch.Generator()
    # one receiver for the whole run: the update's layout is checked against the plan once, not every step
    receiver = WeightReceiver(plan, TorchDistributedTransport(device=device), check_equal=True)
    try:
        while True:
            cmd = _bcast(None, src=0)
            try:
                if cmd[0] == "stop":
                    break
                if cmd[0] == "update":
                    tensors = receiver.receive()
                    engine.load_received(tensors, version=cmd[1])
                    reply = ("ok", None)
                elif cmd[0] == "received":
                    reply = ("ok", {n: _q_to_cpu(v) for n, v in engine.received.items()})
                elif cmd[0] == "generate":
                    _, prompts, kwargs, state = cmd
                    generator.set_state(state)
                    batch = engine.generate(prompts, generator=generator, **kwargs)
                    reply = ("ok", (_to_cpu(batch), generator.get_state()))
                else:
                    reply = ("error", f"unknown command {cmd[0]!r}")
            except Exception as err:  # reported to the trainer, which raises it there
                reply = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}")
            _bcast(reply, src=1)
    finally:
        dist.destroy_process_group()


class _RemoteChannel:
    def __init__(self, owner: "RemoteRollout", bucket_bytes: int):
        self.owner, self.bucket_bytes, self.version = owner, bucket_bytes, 0

    def send(self, weights: dict[str, torch.Tensor]) -> RemotePayload:
        transport = TorchDistributedTransport(device=self.owner.trainer_device)
        sender = WeightSender(self.owner.plan, transport, bucket_bytes=self.bucket_bytes, check_equal=True)
        items = ((n, w.detach().to(torch.bfloat16)) for n, w in weights.items())
        # Everything that can refuse the update (NaN/Inf, missing or extra tensors) runs BEFORE the worker is told
        # an update is coming: a refusal then leaves both processes at the same point of the command protocol
        # (otherwise the worker waits in the handshake while the next command is broadcast: a deadlock).
        units = sender.prepare(items)
        version = self.version + 1
        _bcast(("update", version), src=0)
        try:
            report = sender.send_prepared(units, weight_version=f"v{version}")
        except Exception:
            try:  # the worker saw the abort and replies with its error: collect it to stay in step
                self.owner._reply()
            except RemoteRolloutError:
                pass
            raise
        self.owner._reply()  # the receiver's verdict (hash handshake, digests, load into its buffers)
        self.version = version
        return RemotePayload(plan_hash=report.plan_hash, version=self.version, nbytes=report.bytes,
                             buckets=report.buckets)


class RemoteRollout:
    """Rank-0 proxy of a RolloutEngine running in a spawned process on `rollout_device`."""

    def __init__(self, model_dir: Path, plan: Plan, *, trainer_device: str, rollout_device: str,
                 bucket_bytes: int = 64 << 20, etp: int = 1, numerics: str = "independent"):
        if _backend_for(trainer_device) != _backend_for(rollout_device):
            raise RemoteRolloutError(f"trainer on {trainer_device} and rollout on {rollout_device}: both must be "
                                     "CUDA devices (NCCL) or both CPU (gloo)")
        if rollout_device.startswith("cuda"):
            idx = torch.device(rollout_device).index
            if idx is None or idx >= torch.cuda.device_count():
                raise RemoteRolloutError(f"--rollout-device {rollout_device}: this machine has "
                                         f"{torch.cuda.device_count()} CUDA device(s)")
            if torch.device(trainer_device).index == idx:
                raise RemoteRolloutError("trainer and rollout must be on different GPUs")
        self.plan, self.trainer_device, self.rollout_device = plan, trainer_device, rollout_device
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=rollout_worker, args=(str(model_dir), plan.to_json(), rollout_device, port, etp,
                                                                  numerics),
                                daemon=True)
        self.proc.start()
        _init_group(0, port, trainer_device)
        self.channel = _RemoteChannel(self, bucket_bytes)
        self.version = 0
        self.device = rollout_device

    def _reply(self):
        status, value = _bcast(None, src=1)
        if status != "ok":
            raise RemoteRolloutError(f"rollout process ({self.rollout_device}) failed: {value}")
        return value

    # -- the RolloutEngine interface used by loop.run -----------------------------------------------------------
    def update_weights(self, payload: RemotePayload) -> None:
        self.version = payload.version  # the transfer and its verification already happened in channel.send

    @property
    def received(self) -> dict:
        _bcast(("received",), src=0)
        return self._reply()

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int, pad_id: int,
                 generator: torch.Generator, temperature: float = 1.0) -> SampleBatch:
        kwargs = dict(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature)
        _bcast(("generate", [list(p) for p in prompts], kwargs, generator.get_state()), src=0)
        batch, state = self._reply()
        generator.set_state(state)
        dev = torch.device(self.trainer_device)
        return SampleBatch(tokens=batch.tokens.to(dev), attention_mask=batch.attention_mask.to(dev),
                           response_mask=batch.response_mask.to(dev), logprobs=batch.logprobs.to(dev),
                           prompt_len=batch.prompt_len, routing=batch.routing)

    def gemm_report(self) -> dict[str, int]:
        return {}  # counted in the rollout's own process, not reported back

    def close(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        try:
            _bcast(("stop",), src=0)
            self.proc.join(timeout=60)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.proc.is_alive():
                self.proc.terminate()
            self.proc = None


# -- sharded layouts (several trainer and rollout processes: backends/weight_update/sharded.py) ---------------------
def check_sharded_layout(plan: Plan, arch, layout, force_layout: bool = False) -> list:
    """`policyc check --parallel`'s rules for a ShardedLayout (the rollout's expert TP as SGLang derives it:
    moe_tp = tp / ep). Errors are refused (ContractViolation) unless force_layout; returns the diagnostics."""
    from ..checks import check
    from ..plan import ParallelLayout, ParallelSide
    from .loop import ContractViolation

    parallel = ParallelLayout(
        trainer=ParallelSide(tp=layout.trainer_tp, ep=layout.trainer_ep, etp=layout.trainer_etp),
        rollout=ParallelSide(tp=layout.rollout_tp, ep=layout.rollout_ep, etp=layout.rollout_tp // layout.rollout_ep))
    found = list(check(plan, arch, parallel))
    errors = [d for d in found if d.severity == "error"]
    if errors and not force_layout:
        first = errors[0]
        raise ContractViolation(f"layout refused before launch: [{first.code}] {first.message}"
                                + (f" (hint: {first.hint})" if first.hint else "")
                                + " — pass --force-layout to run it anyway and measure the mismatch")
    return found


def partition_activation_mismatch(plan: Plan, arch_config: dict, layout, x: torch.Tensor,
                                  role: str = "routed_experts.down") -> float:
    """Max |difference| between a down projection's input quantized as the trainer's expert-TP ranks do (each
    quantizes its K slice, so per-token scales are per partition) and as the rollout's real ranks do, over the K
    column ranges the partition rule gives each of them. 0 when the two sides cut K the same way (equal expert TP);
    what `--force-layout` runs to measure otherwise. `x`: [tokens, K] of one tensor of `role`."""
    from ..backends.weight_update.partition import rollout_partition
    from .numerics import fake_quantize, fake_quantize_partitioned

    t = next(t for t in plan.tensors if t.role == role)
    fmt = t.activation
    trainer = fake_quantize_partitioned(x, fmt, layout.trainer_etp if role.startswith("routed_") else
                                        layout.trainer_tp, what=t.hf_name)
    ranges = set()
    for r in range(layout.trainer_world, layout.world):
        s = rollout_partition(plan, arch_config, layout.rollout_rank(r)).get(t.hf_name)
        if s is None:  # an expert of another EP rank
            continue
        ranges.add((0, x.shape[-1]) if s.whole else (s.start, s.stop))
    rollout = torch.empty_like(trainer)
    for a, b in sorted(ranges):
        rollout[..., a:b] = fake_quantize(x[..., a:b].contiguous(), fmt, what=t.hf_name) if fmt.is_quantized \
            else x[..., a:b].float()
    return float((trainer - rollout).abs().max())
