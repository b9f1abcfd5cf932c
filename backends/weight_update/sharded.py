"""A sharded trainer updating a sharded rollout over one torch.distributed group (gloo on CPU, NCCL on GPUs).

World ranks [0, T) are the trainer (Megatron TP and/or EP; one process each), ranks [T, T + R) the rollout (SGLang
TP/EP, R = rollout tp). Every rank calls `ShardedUpdate.update` with the same plan; the update is one fixed sequence
of collectives, so a failure on any rank is seen by all and nobody waits for a message that never comes:

1. plan-hash handshake: every rank all-gathers its plan's content hash; any difference raises `PlanMismatch` on
   every rank, before anything else moves.
2. prepare (nothing sent to the rollout yet): every trainer rank produces its local Megatron state dict; trainer
   rank 0 gathers them (`gather_megatron_shards`: column / row-parallel concat, experts made global), quantizes with
   the converter's own function (`WeightSender.prepare` -> quantize.checkpoint_tensors: share-scale groups and
   per-expert global scales by the plan's rules, over whole tensors) and cuts each rollout rank's partition out of
   those bytes (`partition.partition_tensors`, SGLang's sharding, whole scale blocks). Every rollout rank computes
   what it must receive from the same pure rule (`partition.partition_specs`).
3. vote: all-gather of every rank's status; one failure (a trainer rank's state dict, NaN/Inf, a layout that splits
   a scale block) aborts all ranks with `WeightUpdateAborted`, no byte sent.
4. transfer: trainer rank 0 sends each rollout rank its own partition only, in buckets (meta + one uint8 buffer,
   CRC32-checksummed) preceded by a one-word go/abort header, so a sender failure mid-way releases every receiver.
   Each rollout rank checks the checksums and that it holds exactly its partition's names, dtypes and shapes.
5. commit vote: all-gather again; only when every rank reports success does a rollout rank return (apply) its
   tensors. Otherwise every rank raises WeightUpdateAborted and no rollout rank applies a partial update.

Control objects (statuses, bucket metas) travel with torch.distributed's object collectives between our own
processes (trusted, never user data).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

from precision_dsl.plan import Plan

from precision_dsl.backends.common import PlanMismatch
from precision_dsl.backends.weight_update.buckets import declared_size, pack_bucket, unpack_bucket
from precision_dsl.backends.weight_update.errors import WeightUpdateAborted, WeightUpdateError, WeightUpdateMismatch
from precision_dsl.backends.weight_update.names import RankShard, gather_megatron_shards
from precision_dsl.backends.weight_update.partition import (PartitionError, RolloutRank, partition_specs,
                                                            partition_tensors, rollout_partition)

if TYPE_CHECKING:
    import torch

StateFn = Callable[[], "dict[str, torch.Tensor]"]


@dataclass(frozen=True)
class ShardedLayout:
    """Trainer (Megatron tp, ep, etp) and rollout (SGLang tp, ep) degrees; pp = cp = 1."""

    trainer_tp: int = 1
    trainer_ep: int = 1
    trainer_etp: int = 1
    rollout_tp: int = 1
    rollout_ep: int = 1

    def __post_init__(self):
        for k in ("trainer_tp", "trainer_ep", "trainer_etp", "rollout_tp", "rollout_ep"):
            if getattr(self, k) < 1:
                raise PartitionError(f"{k}={getattr(self, k)} must be >= 1")
        big, small = sorted((self.trainer_tp, self.trainer_ep * self.trainer_etp), reverse=True)
        if big % small:
            raise PartitionError(f"trainer tp={self.trainer_tp} and ep*etp={self.trainer_ep * self.trainer_etp} "
                                 "need one world size divisible by both",
                                 "megatron-core requires world % tp == 0 and world % (etp * ep) == 0")
        RolloutRank(self.rollout_tp, self.rollout_ep, 0)  # ep must divide tp

    @property
    def trainer_world(self) -> int:
        return max(self.trainer_tp, self.trainer_ep * self.trainer_etp)

    @property
    def world(self) -> int:
        return self.trainer_world + self.rollout_tp

    def is_trainer(self, rank: int) -> bool:
        return rank < self.trainer_world

    def trainer_coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, ep_rank, etp_rank) of trainer rank `rank`: dense ranks tp-fastest; expert ranks etp-fastest,
        then ep (megatron-core 0.16 megatron/core/parallel_state.py: the expert RankGenerator's order "tp-ep-dp-pp",
        its tp being expert_tensor_parallel_size)."""
        return rank % self.trainer_tp, (rank // self.trainer_etp) % self.trainer_ep, rank % self.trainer_etp

    def rollout_rank(self, rank: int) -> RolloutRank:
        return RolloutRank(self.rollout_tp, self.rollout_ep, rank - self.trainer_world)


@dataclass
class ShardedReport:
    plan_hash: str
    rank: int
    role: str
    bytes: int = 0  # rollout: bytes it received; trainer rank 0: bytes it sent to all rollout ranks
    buckets: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def _fmt(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:400]


class ShardedUpdate:
    """One per rank for the whole run (it creates the trainer sub-group collectively on construction).

    fault(point, rank): test hook, called at "state", "prepared", "bucket" (trainer rank 0, before each bucket) and
    "received" (a rollout rank, before its commit vote); an exception it raises is that rank's failure."""

    def __init__(self, plan: Plan, layout: ShardedLayout, arch_config: dict, bucket_bytes: int = 64 << 20,
                 group=None, fault: Optional[Callable[[str, int], None]] = None, device: str = "cpu"):
        import torch.distributed as dist

        self.plan, self.layout, self.arch_config = plan, layout, arch_config
        self.bucket_bytes, self.group, self.fault, self.device = int(bucket_bytes), group, fault, device
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != layout.world:
            raise PartitionError(f"the process group has {dist.get_world_size(group)} ranks, the layout needs "
                                 f"{layout.world} ({layout.trainer_world} trainer + {layout.rollout_tp} rollout)")
        # new_group is collective over the whole world: every rank makes it, trainer ranks use it
        self.trainer_group = dist.new_group(list(range(layout.trainer_world)))
        self.plan_hash = plan.content_hash()
        self._parts: dict[int, dict] = {}

    # -- collectives every rank runs in the same order ----------------------------------------------------------------
    def _dist(self):
        import torch.distributed as dist

        return dist

    def _global(self, r: int) -> int:
        return r if self.group is None else self._dist().get_global_rank(self.group, r)

    def _handshake(self) -> None:
        dist = self._dist()
        hashes = [None] * self.layout.world
        dist.all_gather_object(hashes, self.plan_hash, group=self.group)
        bad = [i for i, h in enumerate(hashes) if h != hashes[0]]
        if bad:
            raise PlanMismatch(f"sharded weight update (rank {self.rank})", hashes[0], hashes[bad[0]],
                               hint=f"rank(s) {bad} compiled a different plan than rank 0: every trainer and "
                                    "rollout rank must resolve the same policy for the same model")

    def _vote(self, phase: str, err: Optional[str]) -> None:
        statuses = [None] * self.layout.world
        self._dist().all_gather_object(statuses, err, group=self.group)
        failed = [(i, s) for i, s in enumerate(statuses) if s is not None]
        if failed:
            i, s = failed[0]
            raise WeightUpdateAborted(f"sharded weight update aborted in {phase} on {len(failed)} rank(s), first "
                                      f"rank {i}: {s}")

    def part(self, rollout_world_rank: int) -> dict:
        """The partition {hf_name: Slice} of a rollout rank (pure, memoized)."""
        if rollout_world_rank not in self._parts:
            self._parts[rollout_world_rank] = rollout_partition(self.plan, self.arch_config,
                                                                self.layout.rollout_rank(rollout_world_rank))
        return self._parts[rollout_world_rank]

    # -- entry points --------------------------------------------------------------------------------------------------
    def update(self, state: Union[None, dict, StateFn] = None, weight_version: Optional[str] = None):
        """Trainer ranks: `state` = this rank's local Megatron (or HF) state dict, or a function returning it.
        Returns a ShardedReport. Rollout ranks: returns (their partition's checkpoint tensors, report), only after
        every rank committed."""
        self._handshake()
        if self.layout.is_trainer(self.rank):
            return self._trainer(state, weight_version)
        return self._rollout()

    def _trainer(self, state, weight_version) -> ShardedReport:
        dist = self._dist()
        rep = ShardedReport(self.plan_hash, self.rank, "trainer")
        err: Optional[str] = None
        local = None
        t0 = time.perf_counter()
        try:
            if self.fault:
                self.fault("state", self.rank)
            local = state() if callable(state) else state
            if not isinstance(local, dict):
                raise WeightUpdateError(f"trainer rank {self.rank} has no state dict to send")
        except Exception as e:
            err, local = _fmt(e), None
        box = [None] * self.layout.trainer_world if self.rank == 0 else None
        dist.gather_object((self.layout.trainer_coords(self.rank), local), box, dst=self._global(0),
                           group=self.trainer_group)
        local = None
        payloads: dict[int, list] = {}
        if self.rank == 0:
            rep.seconds["gather"] = time.perf_counter() - t0
            if err is None and all(s is not None for _, s in box):
                try:
                    payloads = self._prepare(box, rep)
                    if self.fault:
                        self.fault("prepared", self.rank)
                except Exception as e:
                    err = _fmt(e)
            box = None
        self._vote("prepare", err)
        t1 = time.perf_counter()
        if self.rank == 0:
            err = self._send_all(payloads, rep)
            rep.seconds["transfer"] = time.perf_counter() - t1
        self._vote("commit", err)
        return rep

    def _prepare(self, box: list, rep: ShardedReport) -> dict[int, list]:
        from precision_dsl.backends.weight_update.sender import WeightSender

        lay = self.layout
        t0 = time.perf_counter()
        shards = [RankShard(tp_rank=c[0], ep_rank=c[1], etp_rank=c[2], state=s) for c, s in box]
        full = gather_megatron_shards(shards, tp=lay.trainer_tp, ep=lay.trainer_ep, etp=lay.trainer_etp)
        t1 = time.perf_counter()
        quantized: dict = {}
        for unit in WeightSender(self.plan, None, arch_config=self.arch_config).prepare(full.items()):
            quantized.update(unit)
        full = None
        t2 = time.perf_counter()
        payloads = {}
        for r in range(lay.trainer_world, lay.world):
            mine = partition_tensors(self.plan, self.part(r), quantized)
            payloads[r] = self._buckets(mine)
        rep.seconds.update(merge=t1 - t0, quantize=t2 - t1, partition=time.perf_counter() - t2)
        return payloads

    def _buckets(self, tensors: dict) -> list:
        out, cur, size = [], {}, 0
        for n, x in tensors.items():
            nb = x.numel() * x.element_size()
            if cur and size + nb > self.bucket_bytes:
                out.append(pack_bucket(cur))
                cur, size = {}, 0
            cur[n] = x
            size += nb
        if cur:
            out.append(pack_bucket(cur))
        return out

    def _send_all(self, payloads: dict[int, list], rep: ShardedReport) -> Optional[str]:
        import torch

        dist = self._dist()
        err: Optional[str] = None
        for r in range(self.layout.trainer_world, self.layout.world):
            dst = self._global(r)
            if err is not None:  # an earlier failure: release this receiver before it reads a bucket
                dist.send_object_list([("abort", err)], dst=dst, group=self.group)
                continue
            buckets = payloads[r]
            dist.send_object_list([("buckets", [m for m, _ in buckets])], dst=dst, group=self.group)
            for meta, buf in buckets:
                go = torch.ones(1, dtype=torch.int64)
                try:
                    if self.fault:
                        self.fault("bucket", self.rank)
                except Exception as e:
                    err = _fmt(e)
                    go.zero_()
                dist.send(go.to(self.device), dst=dst, group=self.group)
                if err is not None:
                    break
                dist.send(buf.to(self.device), dst=dst, group=self.group)
                rep.buckets += 1
                rep.bytes += buf.numel()
        return err

    def _rollout(self):
        import torch

        dist = self._dist()
        rep = ShardedReport(self.plan_hash, self.rank, "rollout")
        err: Optional[str] = None
        want = None
        try:
            want = partition_specs(self.plan, self.part(self.rank))
        except Exception as e:
            err = _fmt(e)
        self._vote("prepare", err)
        t0 = time.perf_counter()
        src = self._global(0)
        box = [None]
        dist.recv_object_list(box, src=src, group=self.group)
        kind, body = box[0]
        got: dict = {}
        if kind == "abort":
            err = f"the sender aborted before this rank's buckets: {body}"
        else:
            for meta in body:
                go = torch.empty(1, dtype=torch.int64, device=self.device)
                dist.recv(go, src=src, group=self.group)
                if int(go.item()) == 0:
                    err = "the sender aborted part-way through this rank's buckets"
                    break
                buf = torch.empty(declared_size(meta), dtype=torch.uint8, device=self.device)
                dist.recv(buf, src=src, group=self.group)
                rep.buckets += 1
                rep.bytes += buf.numel()
                if err is None:
                    try:
                        got.update(unpack_bucket(meta, buf.cpu()))
                    except WeightUpdateError as e:
                        err = _fmt(e)
        rep.seconds["transfer"] = time.perf_counter() - t0
        if err is None:
            try:
                self._check(got, want)
                if self.fault:
                    self.fault("received", self.rank)
            except Exception as e:
                err = _fmt(e)
        try:
            self._vote("commit", err)
        except WeightUpdateAborted:
            got.clear()  # nothing of a failed update is kept
            raise
        return got, rep

    @staticmethod
    def _check(got: dict, want: dict) -> None:
        from precision_dsl.backends.safetensors_io import _TORCH_DT

        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise WeightUpdateMismatch(f"this rank's update does not match its partition: {len(missing)} missing "
                                       f"(e.g. {missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
        for n, (dt, sh) in want.items():
            x = got[n]
            if str(x.dtype).replace("torch.", "") != _TORCH_DT[dt] or tuple(x.shape) != sh:
                raise WeightUpdateMismatch(f"tensor '{n}' arrived as {x.dtype} {tuple(x.shape)}, its partition "
                                           f"says {dt} {sh}")
