"""Live weight update: trainer weights -> the rollout's quantized tensors, bucketed, over a transport.

The bytes come from `precision_dsl.backends.quantize.checkpoint_tensors`, the same function the checkpoint converter uses, so
for the same weights the update path and `policyc convert` produce byte-identical tensors (tested per format).

API (used by the RL engine)::

    from precision_dsl.backends.weight_update import WeightSender, WeightReceiver, InProcessTransport

    transport = InProcessTransport()                      # or TorchDistributedTransport(), SGLangHTTPTransport(url)
    report = WeightSender(plan, transport, bucket_bytes=512 << 20).send(state_dict_iter, weight_version="step-7")
    weights = WeightReceiver(plan, transport).receive()   # {hf_name: QuantizedTensor | Tensor}

* `state_dict_iter` yields (name, tensor) pairs named either like the HF checkpoint
  (`model.layers.3.mlp.experts.17.gate_proj.weight`) or like Megatron-core (`decoder.layers.3.mlp.experts.
  linear_fc1.weight17`, fused fc1 = [gate; up], linear_qkv grouped per KV head), full (TP-gathered) tensors with
  GLOBAL expert indices. `gather_megatron_shards(...)` turns per-rank TP/EP shards into that form first.
* Work units: members of an NVFP4 share-scale group are quantized together (one global amax). Atomic groups
  (fused siblings: q/k/v, gate/up, q_a/kv_a; SGLang's loader needs both halves in one load_weights call) always
  travel in one bucket. Buckets are filled up to `bucket_bytes` (a unit larger than that travels alone).
* All or nothing: `prepare` (names, completeness against the plan for EVERY tensor, no extras or duplicates,
  quantization, NaN/Inf before and after every cast -> `NonFiniteWeight`) runs before the transport is opened; a
  failure after that calls `transport.abort` (receivers discard the partial update; the SGLang client closes the
  bracket and reloads the served checkpoint, or marks the version `incomplete:`) and raises WeightUpdateAborted.
  Receivers apply nothing until every tensor of the plan arrived with its planned dtype and shape.
* Every bucket carries a cheap checksum (CRC32 on host buffers, a device-side sum64 on GPU buffers), always on.
* Both ends check the plan content hash first (in-process / torch.distributed: a symmetric handshake; SGLang: the
  served checkpoint's policyc_plan.json) and refuse a mismatch with `PlanMismatch`.
* `check_equal=True` (like Miles' --check-weight-update-equal): the sender ships a sha256 per tensor with the last
  message; the receiver compares what it holds and raises `WeightUpdateMismatch` listing the differing tensors.

Transports:
  InProcessTransport            a queue (sender and receiver in one process; used by the embedded RL engine)
  TorchDistributedTransport     broadcast from `src` over a torch.distributed group (gloo on CPU, NCCL on GPU)
  SGLangHTTPTransport           SGLang 0.5.23 HTTP: begin_weight_update -> update_weights_from_tensor or
                                update_weights_from_distributed (per bucket) -> end_weight_update
                                (payloads: ../shared/research/backends.md §C.6)
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import math
import queue
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

from precision_dsl.plan import Plan, TensorPlan

from precision_dsl.backends.common import PLAN_FILE, PlanMismatch
from precision_dsl.backends.common import plan_hash as _plan_hash
from precision_dsl.backends.quantize import NonFiniteWeight, checkpoint_tensors, needs_shared_amax, read_quantized
from precision_dsl.errors import PolicycError

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSender", "WeightReceiver", "InProcessTransport", "TorchDistributedTransport",
           "SGLangHTTPTransport", "megatron_to_hf", "gather_megatron_shards", "RankShard", "NonFiniteWeight",
           "PlanMismatch", "WeightUpdateMismatch", "WeightUpdateError", "WeightUpdateAborted", "SendReport",
           "bucket_checksum"]


class WeightUpdateError(PolicycError, RuntimeError):
    code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class WeightUpdateMismatch(WeightUpdateError):
    """The receiver does not hold what the sender sent (equality check)."""


class WeightUpdateAborted(WeightUpdateError):
    """The update stopped part-way; the consumer did not apply it (or was rolled back: see `served_version`)."""

    def __init__(self, message: str, hint: str = "", served_version: Optional[str] = None):
        super().__init__(message, hint or "the rollout keeps serving its previous weights; fix the cause and resend")
        self.served_version = served_version


# ---------------------------------------------------------------------------------------------------------------
# Megatron -> HF names
# ---------------------------------------------------------------------------------------------------------------
def _qkv_geometry(plan: Plan, layer_key: tuple, arch_config: Optional[dict]) -> tuple[int, int, int]:
    """(num_query_groups, q_heads_per_group, head_dim) for one layer's linear_qkv."""
    q = k = qn = None
    for t in plan.tensors:
        if (t.mtp, t.layer) != layer_key:
            continue
        if t.role == "attn.q":
            q = t
        elif t.role == "attn.k":
            k = t
        elif t.role == "norm.q":
            qn = t
    hd = None
    if arch_config:
        hd = arch_config.get("head_dim") or (arch_config["hidden_size"] // arch_config["num_attention_heads"]
                                             if "num_attention_heads" in arch_config else None)
    if hd is None and qn is not None:
        hd = qn.shape[0]
    if hd is None or q is None or k is None:
        raise WeightUpdateError(f"cannot split linear_qkv of layer {layer_key}: head_dim unknown",
                                "pass arch_config=<config.json dict> to WeightSender")
    ng = k.shape[0] // hd
    return ng, q.shape[0] // hd // ng, hd


class _NameMap:
    def __init__(self, plan: Plan, arch_config: Optional[dict] = None):
        self.plan = plan
        self.arch_config = arch_config
        self.hf = plan.by_name()
        self.meg: dict[str, list[TensorPlan]] = {}
        for t in plan.tensors:
            if t.megatron_name:
                self.meg.setdefault(t.megatron_name, []).append(t)

    def to_hf(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name in self.hf:
            return [(name, x)]
        ts = self.meg.get(name)
        if not ts:
            raise WeightUpdateError(f"weight '{name}' is neither an HF nor a Megatron name of the plan's model "
                                    f"'{self.plan.model}'", "is the trainer running the model the plan was made for?")
        if len(ts) == 1 and ts[0].megatron_part is None:
            return [(ts[0].hf_name, x)]
        parts = {t.megatron_part: t for t in ts}
        if set(parts) == {"gate", "up"}:
            g, u = x.chunk(2, dim=0)  # fc1 = cat([gate, up], 0) (Megatron-Bridge GatedMLPMapping)
            return [(parts["gate"].hf_name, g), (parts["up"].hf_name, u)]
        if set(parts) == {"q", "k", "v"}:
            ng, qpg, hd = _qkv_geometry(self.plan, (ts[0].mtp, ts[0].layer), self.arch_config)
            hidden = x.shape[-1]
            # grouped per KV head: [ng, (qpg + 2) * hd, hidden], split [qpg, 1, 1] heads (Bridge QKVMapping)
            v3 = x.reshape(ng, qpg + 2, hd, hidden)
            q = v3[:, :qpg].reshape(ng * qpg * hd, hidden)
            k = v3[:, qpg].reshape(ng * hd, hidden)
            v = v3[:, qpg + 1].reshape(ng * hd, hidden)
            return [(parts["q"].hf_name, q), (parts["k"].hf_name, k), (parts["v"].hf_name, v)]
        raise WeightUpdateError(f"no split rule for Megatron weight '{name}' (parts {sorted(map(str, parts))})")


def megatron_to_hf(plan: Plan, name: str, x: torch.Tensor, arch_config: Optional[dict] = None):
    """HF (name, tensor) pairs of one full Megatron (or HF) weight."""
    return _NameMap(plan, arch_config).to_hf(name, x)


@dataclass
class RankShard:
    """One trainer rank's local state dict and its coordinates (Megatron parallel state)."""

    tp_rank: int
    state: dict[str, torch.Tensor]
    ep_rank: int = 0
    etp_rank: int = 0


_ROW_PARALLEL_RE = re.compile(r"\.(linear_proj|linear_fc2)\.weight\d*$")
_COLUMN_PARALLEL_RE = re.compile(r"\.(linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|"
                                 r"eh_proj)\.weight\d*$|^(embedding\.word_embeddings|output_layer)\.weight$")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def gather_megatron_shards(shards: Sequence[RankShard], tp: int = 1, ep: int = 1,
                           etp: int = 1) -> dict[str, torch.Tensor]:
    """Full Megatron weights (global expert indices) from per-rank TP/EP shards.

    * column-parallel (linear_qkv, linear_fc1, q/kv up-projections, embeddings, output_layer): concat on dim 0;
      linear_fc1 shards are [gate_i; up_i] each, so the full tensor is [gate_0..gate_n; up_0..up_n];
      linear_qkv shards hold whole KV groups, so a plain concat keeps the per-KV-head grouping;
    * row-parallel (linear_proj, linear_fc2): concat on dim 1;
    * expert weights: split over expert-TP (etp ranks), local index k on EP rank r is global r * E_local + k;
    * everything else (norms, router, MLA down-projections, which megatron-core keeps duplicated): replicated,
      checked equal across ranks."""
    import torch

    experts_local = None
    by_coord: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for s in shards:
        by_coord[(s.tp_rank, s.ep_rank, s.etp_rank)] = s.state
        for n in s.state:
            m = _EXPERT_RE.match(n)
            if m:
                experts_local = max(experts_local or 0, int(m.group(2)) + 1)
    out: dict[str, torch.Tensor] = {}
    names = sorted({n for s in shards for n in s.state})
    for n in names:
        m = _EXPERT_RE.match(n)
        if m:
            base, local = m.group(1), int(m.group(2))
            for er in range(ep):
                pieces_by_etp = {c[2]: by_coord[c][n] for c in sorted(by_coord) if c[1] == er and n in by_coord[c]}
                pieces = [pieces_by_etp[i] for i in range(etp)]
                out[f"{base}{er * experts_local + local}"] = _cat(n, pieces)
            continue
        pieces_by_tp = {}
        for c in sorted(by_coord):
            if n in by_coord[c]:
                pieces_by_tp.setdefault(c[0], by_coord[c][n])
        pieces = [pieces_by_tp[i] for i in range(tp)] if len(pieces_by_tp) == tp else list(pieces_by_tp.values())
        if tp > 1 and (_COLUMN_PARALLEL_RE.search(n) or _ROW_PARALLEL_RE.search(n)):
            out[n] = _cat(n, pieces)
        else:
            for p in pieces[1:]:
                if not torch.equal(p, pieces[0]):
                    raise WeightUpdateError(f"replicated weight '{n}' differs across TP ranks")
            out[n] = pieces[0]
    return out


def _cat(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    import torch

    if len(pieces) == 1:
        return pieces[0]
    if _ROW_PARALLEL_RE.search(name):
        return torch.cat(pieces, dim=1)
    if ".linear_fc1." in name:
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=0)


# ---------------------------------------------------------------------------------------------------------------
# wire messages
# ---------------------------------------------------------------------------------------------------------------
def _dtypes() -> dict:
    import torch

    return {str(d).replace("torch.", ""): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8,
                                                     torch.float8_e4m3fn, torch.float8_e5m2, torch.int64)}


def _digest(t: torch.Tensor) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def bucket_checksum(buf: torch.Tensor, algo: Optional[str] = None) -> str:
    """Cheap integrity check of a bucket's bytes, always on (a full sha256 per tensor is `check_equal`).
    Host buffers: CRC32 (zlib, ~1 GB/s per core here; see benchmarks/RESULTS.md). Device buffers: two wrapping int64
    sums over 8-byte words (plain and position-weighted, so reordered words change it), computed where the bytes
    are, with no host copy; the receiver recomputes the algorithm the sender named."""
    import torch

    algo = algo or ("crc32" if buf.device.type == "cpu" else "sum64")
    flat = buf.reshape(-1).view(torch.uint8)
    if algo == "crc32":
        import zlib

        return f"crc32:{zlib.crc32(memoryview(flat.cpu().numpy())):08x}"
    if algo != "sum64":
        raise WeightUpdateError(f"unknown bucket checksum algorithm {algo!r}")
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int64)
    s1 = s2 = 0
    step = 1 << 23  # 64 MiB of words per chunk bounds the temporaries
    for i in range(0, words.numel(), step):
        w = words[i:i + step]
        idx = torch.arange(i + 1, i + 1 + w.numel(), device=w.device, dtype=torch.int64)
        s1 = (s1 + int(w.sum())) & ((1 << 64) - 1)
        s2 = (s2 + int((w * idx).sum())) & ((1 << 64) - 1)
    return f"sum64:{n:x}:{s1:016x}:{s2:016x}"


def pack_bucket(tensors: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """(meta {names, dtypes, shapes}, one flat uint8 buffer) for a bucket: what a broadcast transport moves."""
    import torch

    names = list(tensors)
    flats = [tensors[n].contiguous().reshape(-1).view(torch.uint8) for n in names]
    # A unit may mix devices (quantized data on the GPU, a constant such as NVFP4 input_scale made on the CPU):
    # the bucket lives where its bulk is.
    dev = next((f.device for f in flats if f.device.type != "cpu"), None)
    if dev is not None:
        flats = [f.to(dev) for f in flats]
    meta = {"names": names, "dtypes": [str(tensors[n].dtype).replace("torch.", "") for n in names],
            "shapes": [list(tensors[n].shape) for n in names], "nbytes": [f.numel() for f in flats]}
    buf = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
    meta["checksum"] = bucket_checksum(buf)
    return meta, buf


def unpack_bucket(meta: dict, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    # GPU-program buckets ("offsets" layout) carry no per-bucket checksum in their meta (they are filled on the
    # GPU after the layout is sent): WeightReceiver checks them against the on-GPU fingerprints of the closing
    # message instead, and they never come through here.
    want = meta.get("checksum")
    if not isinstance(want, str):
        raise WeightUpdateMismatch("bucket carries no checksum", "sender and receiver must run the same policyc")
    got = bucket_checksum(buf, want.split(":", 1)[0])
    if got != want:
        raise WeightUpdateMismatch(f"bucket of {len(meta.get('names', []))} tensors (first "
                                   f"'{(meta.get('names') or ['?'])[0]}') arrived corrupted: checksum {got}, "
                                   f"sender computed {want}")
    dtypes = _dtypes()
    out, off = {}, 0
    for n, dt, shape, nb in zip(meta["names"], meta["dtypes"], meta["shapes"], meta["nbytes"]):
        if dt not in dtypes:
            raise WeightUpdateError(f"bucket tensor '{n}' has unsupported dtype {dt!r}")
        out[n] = buf[off:off + nb].clone().view(dtypes[dt]).reshape(shape)
        off += nb
    if off != buf.numel():
        raise WeightUpdateError(f"bucket declares {off} bytes but carries {buf.numel()}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# transports
# ---------------------------------------------------------------------------------------------------------------
class InProcessTransport:
    """A queue between a sender and a receiver in the same process (or threads)."""

    gpu_program = True  # CUDA senders take the GPU update program (copy stream, see send_gpu_bucket)

    def __init__(self, persistent: bool = False):
        """persistent: GPU buckets land in receiver buffers kept from one update to the next (bucket k of every
        update overwrites the same memory, as a rollout engine updates its weights in place; views received
        earlier then show the new weights; receive each update before the next is sent). Default: fresh
        buffers per update."""
        self._q: "queue.Queue" = queue.Queue()
        self.persistent = persistent
        self._dst: dict = {}
        self._k = 0

    # sender side
    def open(self, plan_hash: str) -> None:
        self._k = 0
        self._q.put(("open", {"plan_hash": plan_hash}, None, None))

    def send_bucket(self, meta: dict, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
        self._q.put(("bucket", meta, buf.clone(), None))

    def send_gpu_bucket(self, meta: dict, buf: torch.Tensor):
        """Copy a GPU bucket into a fresh receiver-side buffer on a separate copy stream (ordered after the work
        that filled it), so the sender can fill the next bucket meanwhile. Returns a handle whose wait() makes
        the sender's stream wait for the copy before it reuses `buf`; nothing blocks the host."""
        import torch

        cur = torch.cuda.current_stream(buf.device)
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(buf.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            dst = self._dst.get(self._k) if self.persistent else None
            if dst is None or dst.numel() != buf.numel():
                dst = torch.empty_like(buf)
                if self.persistent:
                    self._dst[self._k] = dst
            self._k += 1
            dst.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        dst.record_stream(cur)  # the receiver reads it on the current stream
        self._q.put(("bucket", meta, dst, ev))
        return _StreamWait(ev)

    def close(self, summary: dict) -> None:
        self._q.put(("close", summary, None, None))

    def abort(self, reason: str) -> None:
        self._q.put(("abort", {"reason": reason}, None, None))

    # receiver side
    def recv(self, timeout: Optional[float] = None):
        kind, meta, buf, ev = self._q.get(timeout=timeout)
        if ev is not None:
            import torch

            torch.cuda.current_stream(buf.device).wait_event(ev)
        return kind, meta, buf

    def handshake(self, plan_hash: str) -> None:
        kind, meta, _ = self.recv(timeout=60)
        if kind != "open":
            raise WeightUpdateError(f"expected an 'open' message, got '{kind}'")
        if meta["plan_hash"] != plan_hash:
            raise PlanMismatch("weight update receiver", plan_hash, meta["plan_hash"])


class _StreamWait:
    def __init__(self, ev):
        self.ev = ev

    def wait(self) -> None:
        import torch

        torch.cuda.current_stream().wait_event(self.ev)


class TorchDistributedTransport:
    """Broadcast over a torch.distributed process group from rank `src` (gloo on CPU, NCCL on GPU: tensors are moved
    to `device` before the collective). Every rank first all-gathers its plan hash, so all ranks refuse together."""

    def __init__(self, group=None, src: int = 0, device: str = "cpu", gpu_program: bool = False):
        # gpu_program: CUDA senders use the GPU update program (layout once, async NCCL broadcasts of
        # double-buffered buckets). Off by default until it has run on a two-GPU machine (issue 12).
        self.group, self.src, self.device, self.gpu_program = group, src, device, gpu_program
        self._sent_layout: Optional[list] = None  # sender: the program layout last broadcast whole
        self._layout: Optional[list] = None  # receiver: the layout last received whole

    def _dist(self):
        import torch.distributed as dist

        return dist

    def _check_hash(self, plan_hash: str) -> None:
        dist = self._dist()
        hashes = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(hashes, plan_hash, group=self.group)
        bad = [i for i, h in enumerate(hashes) if h != hashes[self.src]]
        if bad:
            raise PlanMismatch(f"torch.distributed weight update (rank {dist.get_rank(self.group)})", hashes[self.src],
                               hashes[bad[0]], hint=f"rank(s) {bad} compiled a different plan")

    def open(self, plan_hash: str) -> None:
        self._check_hash(plan_hash)

    handshake = open

    def _bcast_obj(self, obj):
        box = [obj]
        self._dist().broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def send_bucket(self, meta: dict, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
        self._bcast_obj(("bucket", meta))
        b = buf.to(self.device)
        self._dist().broadcast(b, src=self.src, group=self.group)

    def send_layout(self, metas: list) -> None:
        """GPU update program: every bucket's layout in one object broadcast, then buffers only. The layout is sent
        whole once per transport; later updates with the same program send only a reference to it (pickling ~75k
        tensor names on one end and unpickling them on the other cost tens of ms per update at 30B)."""
        if metas is self._sent_layout:
            self._bcast_obj(("layout", None))
            return
        self._bcast_obj(("layout", metas))
        self._sent_layout = metas

    def send_gpu_bucket(self, meta: dict, buf: torch.Tensor):
        """Asynchronous broadcast of a GPU bucket (NCCL orders it after the work that filled `buf`); the returned
        work's wait() makes the sender's stream - not the host - wait before `buf` is reused."""
        return self._dist().broadcast(buf, src=self.src, group=self.group, async_op=True)

    def close(self, summary: dict) -> None:
        self._bcast_obj(("close", summary))

    def abort(self, reason: str) -> None:
        # Sent between two messages (the sender failed before its next collective), so the receivers are waiting
        # for exactly this object: they raise WeightUpdateAborted and the group stays usable.
        self._bcast_obj(("abort", {"reason": reason}))

    def recv(self, timeout: Optional[float] = None):
        import torch

        pending = getattr(self, "_pending", None)
        if pending:
            meta = pending.pop(0)
            buf = torch.empty(meta["total"], dtype=torch.uint8, device=self.device)
            self._dist().broadcast(buf, src=self.src, group=self.group)
            return "bucket", meta, buf
        kind, meta = self._bcast_obj(None)
        if kind == "layout":
            if meta is None:  # "the same layout as last time" (see send_layout)
                meta = self._layout
                if meta is None:
                    raise WeightUpdateMismatch("the sender referred to a bucket layout this receiver never got",
                                               "keep one TorchDistributedTransport per end for the whole run")
            self._layout = meta
            self._pending = list(meta)
            return self.recv(timeout)
        if kind in ("close", "abort"):
            self._pending = []
            return kind, meta, None
        buf = torch.empty(sum(meta["nbytes"]), dtype=torch.uint8, device=self.device)
        self._dist().broadcast(buf, src=self.src, group=self.group)
        return kind, meta, buf  # stays on the receiver's device (a GPU rollout loads it without a host round trip)


class SGLangHTTPTransport:
    """Client of a running SGLang 0.5.23 server.

    mode="tensor": POST /update_weights_from_tensor {serialized_named_tensors: [base64] * tp_size, load_format:
    null, flush_cache: false, weight_version}. The payload is SGLang's own `MultiprocessingSerializer` format
    (base64 of a torch ForkingPickler dump of [(name, tensor), ...]); SGLang defines this protocol (it is pickle on
    the server side - only point this at a server you run). The tensors travel as torch multiprocessing handles
    (CUDA IPC for GPU tensors), so this mode is for a server colocated on the same host, as in Miles/slime. mode="distributed": POST
    /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache: false, weight_version} while
    this process broadcasts each tensor from rank 0 of the update group (`broadcast_fn(tensor)`; the group is set
    up with /init_weights_update_group by the caller).

    The update is bracketed by POST /begin_weight_update {selector} and POST /end_weight_update {} (SGLang rejects
    update_* outside the bracket). On open, GET /get_model_info gives the served model_path; its policyc_plan.json
    must carry the sender's plan hash (`allow_unverified=True` skips this when the path is not readable here)."""

    def __init__(self, base_url: str, mode: str = "tensor", tp_size: int = 1, selector: str = "target",
                 group_name: str = "weight_update_group", broadcast_fn: Optional[Callable] = None,
                 allow_unverified: bool = False, timeout: float = 600.0, rollback: str = "disk"):
        if mode not in ("tensor", "distributed"):
            raise ValueError("mode must be 'tensor' or 'distributed'")
        if mode == "distributed" and broadcast_fn is None:
            raise ValueError("mode='distributed' needs broadcast_fn(tensor) "
                             "(a torch.distributed broadcast from rank 0)")
        self.base_url = base_url.rstrip("/")
        self.mode, self.tp_size, self.selector, self.group_name = mode, tp_size, selector, group_name
        self.broadcast_fn, self.allow_unverified, self.timeout = broadcast_fn, allow_unverified, timeout
        if rollback not in ("disk", "none"):
            raise ValueError("rollback must be 'disk' (reload the served checkpoint on failure) or 'none'")
        self.rollback = rollback
        self.weight_version: Optional[str] = None
        self.previous_version: Optional[str] = None  # what the server reported before this update
        self.served_version: Optional[str] = None  # what it reports after close/abort
        self._model_path: Optional[str] = None  # the served checkpoint, once verified to carry our plan
        self._begun = False

    def _call(self, method: str, path: str, body: Optional[dict] = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raise WeightUpdateError(f"SGLang {path} returned HTTP {err.code}: {err.read()[:300]!r}") from None
        except urllib.error.URLError as err:
            raise WeightUpdateError(f"cannot reach SGLang at {self.base_url}: {err.reason}",
                                    "is the server running? check the URL/port") from None
        except (OSError, http.client.HTTPException) as err:  # reset, timeout, truncated response
            raise WeightUpdateError(f"SGLang {path}: connection failed ({type(err).__name__}: {err})") from None
        from precision_dsl.jsonsafe import loads_bounded

        out = loads_bounded(raw, f"SGLang {path} response", WeightUpdateError, max_bytes=16 << 20) if raw else {}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightUpdateError(f"SGLang {path} failed: {str(out.get('message'))[:300]}")
        return out if isinstance(out, dict) else {}

    def model_info(self) -> dict:
        """GET /model_info (SGLang 0.5.23; /get_model_info is its deprecated alias, used for older servers)."""
        try:
            return self._call("GET", "/model_info")
        except WeightUpdateError as err:
            if "HTTP 404" not in str(err):
                raise
            return self._call("GET", "/get_model_info")

    def open(self, plan_hash: str) -> None:
        info = self.model_info()
        self.previous_version = info.get("weight_version")
        path = Path(str(info.get("model_path", ""))) / PLAN_FILE
        if path.is_file():
            try:
                from precision_dsl.backends.converter import read_plan

                got = read_plan(path.parent).content_hash()
            except ValueError:  # CheckpointError: unreadable / not a plan
                got = None
            if got != plan_hash:
                raise PlanMismatch(f"SGLang server {self.base_url} (serving {info.get('model_path')})", plan_hash, got)
            self._model_path = str(info.get("model_path"))
        elif not self.allow_unverified:
            raise PlanMismatch(f"SGLang server {self.base_url}", plan_hash, None,
                               hint=f"the served model_path has no readable {PLAN_FILE}; serve a `policyc convert` "
                                    "output or pass allow_unverified=True")
        self._call("POST", "/begin_weight_update", {"selector": self.selector})
        self._begun = True

    def send_bucket(self, meta: dict, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
        if self.mode == "tensor":
            from multiprocessing.reduction import ForkingPickler
            import io

            bio = io.BytesIO()
            ForkingPickler(bio).dump(list(tensors.items()))
            payload = base64.b64encode(bio.getvalue()).decode()
            self._call("POST", "/update_weights_from_tensor",
                       {"serialized_named_tensors": [payload] * self.tp_size, "load_format": None,
                        "flush_cache": False, "weight_version": None})
            return
        body = {"names": meta["names"], "dtypes": meta["dtypes"], "shapes": meta["shapes"],
                "group_name": self.group_name, "flush_cache": False, "weight_version": None}
        errors: list[BaseException] = []

        def post():
            try:
                self._call("POST", "/update_weights_from_distributed", body)
            except BaseException as err:  # surfaced after the broadcasts
                errors.append(err)

        th = threading.Thread(target=post, daemon=True)
        th.start()
        for n in meta["names"]:
            self.broadcast_fn(tensors[n])
        th.join()
        if errors:
            raise errors[0]

    # Buckets carry weight_version None: SGLang sets its version on every successful update_* call, so a version
    # sent with bucket 1 would be reported while buckets 2..n are still missing. The version is set once, after
    # end_weight_update, and read back: the server's answer is what `served_version` reports.
    def close(self, summary: dict) -> None:
        self._call("POST", "/end_weight_update", {})
        self._begun = False
        if self.weight_version is not None:
            self._call("POST", "/update_weight_version", {"new_version": str(self.weight_version),
                                                          "abort_all_requests": False})
        self.served_version = self.model_info().get("weight_version")
        if self.weight_version is not None and self.served_version != str(self.weight_version):
            raise WeightUpdateError(f"SGLang reports weight_version {self.served_version!r} after the update to "
                                    f"{self.weight_version!r}")

    def abort(self, reason: str) -> Optional[str]:
        """After a failure between begin and the end of close: close the bracket, then either reload the served
        checkpoint from disk (rollback='disk', the default once its plan was verified) or mark the served weights
        `incomplete:<version>` so every response's meta_info shows they are not a complete update. SGLang 0.5.23
        has no transactional update (each bucket loads in place), so one of the two is the only honest end state.
        Returns the version the server reports afterwards (best effort; never raises)."""
        if self._begun:
            try:
                self._call("POST", "/end_weight_update", {})
            except WeightUpdateError:
                pass
            self._begun = False
        label = None
        if self.rollback == "disk" and self._model_path is not None:
            label = f"checkpoint:{self._model_path}"
            try:
                self._call("POST", "/update_weights_from_disk", {"model_path": self._model_path, "weight_version": label,
                                                                 "flush_cache": True, "abort_all_requests": True})
            except WeightUpdateError:
                label = None
        if label is None:
            try:
                self._call("POST", "/update_weight_version", {"new_version": f"incomplete:{self.weight_version}",
                                                              "abort_all_requests": True})
            except WeightUpdateError:
                pass
        try:
            self.served_version = self.model_info().get("weight_version")
        except WeightUpdateError:
            self.served_version = None
        return self.served_version


# ---------------------------------------------------------------------------------------------------------------
# sender / receiver
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SendReport:
    plan_hash: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    bucket_names: list[list[str]] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)


def atomic_groups(plan: Plan) -> dict[tuple, set[str]]:
    """Atomic units of an update: fused-sibling instances (q/k/v, gate/up, q_a/kv_a, one expert's gate/up) merged
    with NVFP4 share-scale groups; every other tensor is a unit of one. A unit always travels in one bucket."""
    group_of = {m: g.id for g in plan.share_scale_groups for m in g.members}
    need: dict[tuple, set[str]] = {}
    share_in_fused: list[tuple[tuple, tuple]] = []  # (share unit, fused unit) of each shared-amax fused tensor
    for t in plan.tensors:
        name, fi = t.hf_name, t.fused_key
        gid = group_of.get(name)
        if gid is not None and needs_shared_amax(t):
            key = ("share", gid)
            if fi is not None:
                share_in_fused.append((key, ("fused",) + fi))
        else:
            key = ("fused",) + fi if fi is not None else ("one", name)
        names = need.get(key)
        if names is None:
            names = need[key] = set()
        names.add(name)
    parent = {k: k for k in need}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for share, fused in share_in_fused:  # a share-scale group overlapping a fused instance (gate/up) joins it
        if fused in need:
            parent[find(share)] = find(fused)
    members: dict[tuple, set[str]] = {}
    for k, ns in need.items():
        members.setdefault(find(k), set()).update(ns)
    return members


def emit(plan: Plan, bucket_bytes: int = 512 << 20):
    """weight_update/manifest.json: per Megatron parameter, the HF tensors it becomes and the exact rollout tensors
    (name, dtype, shape) the update sends; the atomic groups; the bucket count at `bucket_bytes`."""
    from precision_dsl.backends.common import Artifact, dump_json, plan_stamp
    from precision_dsl.backends.quantize import check_all_supported, plan_output_specs
    from precision_dsl.backends.safetensors_io import DTYPE_SIZES

    check_all_supported(plan, "weight_update")
    params: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    # output bytes by what output_specs reads (weight format object, linear?, shape): a few dozen distinct among 46k
    size_of: dict[tuple, int] = {}
    prod = math.prod
    for t, specs in zip(plan.tensors, plan_output_specs(plan)):
        layout = (id(t.precision.weight), t.is_linear, t.shape)  # the plan keeps the formats alive
        nbytes = size_of.get(layout)
        if nbytes is None:
            nbytes = size_of[layout] = sum([DTYPE_SIZES[dt] * prod(sh) for _, dt, sh in specs])
        sizes[t.hf_name] = nbytes
        entry = params.get(t.megatron_name or t.hf_name)
        if entry is None:  # specs are (name, dtype, shape) tuples: JSON writes them as the [name, dtype, [dims]] lists
            params[t.megatron_name or t.hf_name] = {"hf": [t.hf_name], "outputs": list(specs)}
        else:
            entry["hf"].append(t.hf_name)
            entry["outputs"].extend(specs)
    atoms = atomic_groups(plan)
    groups = [sorted(ns) for ns in atoms.values() if len(ns) > 1]
    order = {t.hf_name: i for i, t in enumerate(plan.tensors)}
    buckets, size = 0, 0
    for ns in sorted(atoms.values(), key=lambda ns: max([order[n] for n in ns])):
        nb = sum([sizes[n] for n in ns])
        if size and size + nb > bucket_bytes:
            buckets, size = buckets + 1, 0
        size += nb
    buckets += 1 if size else 0
    manifest = {"policyc": plan_stamp(plan), "bucket_bytes": bucket_bytes, "buckets": buckets,
                "atomic_groups": sorted(groups), "params": params}
    return [Artifact("weight_update/manifest.json", dump_json(manifest, compact=True),
                     "Megatron param -> rollout tensors (name, dtype, shape), atomic groups, buckets")]


class WeightSender:
    def __init__(self, plan: Plan, transport, bucket_bytes: int = 512 << 20, check_equal: bool = False,
                 arch_config: Optional[dict] = None, min_buckets: int = 8, gpu_program: Optional[bool] = None):
        # gpu_program: None = the GPU update program whenever the transport takes GPU buffers (its `gpu_program`)
        # and the weights are CUDA tensors; False = always the per-unit path (a caller whose weights are fresh
        # tensors each update: the program binds the sender's tensors once and expects them updated in place)
        # min_buckets (GPU update program only): shrink the buckets until the update has at least this many, so
        # quantization overlaps the transfer even for a small model (bucket_bytes stays the upper bound). 8: the
        # 1.34B NVFP4 update over NCCL went 2.11x -> 1.96x a bare broadcast with it (16: 2.24x; same H200-x2 run,
        # benchmarks/results_s9_wu_nccl_min_buckets.json); models of >= 8 full buckets are unaffected
        self.plan, self.transport, self.bucket_bytes = plan, transport, int(bucket_bytes)
        self.min_buckets = max(1, int(min_buckets))
        self.check_equal = check_equal
        self.gpu_program = gpu_program
        self.names = _NameMap(plan, arch_config)
        self._groups = {m: g for g in plan.share_scale_groups for m in g.members}
        self._order = {t.hf_name: i for i, t in enumerate(plan.tensors)}

    def over(self, transport) -> "WeightSender":
        """This sender - its plan, name map and compiled GPU update program (with any binding made from it) - sending
        over another transport: a caller can give every update its own transport while the program is built once."""
        import copy

        other = copy.copy(self)
        other.transport = transport
        return other

    def _atomic_units(self, items: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[list[tuple[TensorPlan, torch.Tensor]]]:
        """Yield complete atomic units (fused siblings + share-scale groups) as soon as all members arrived."""
        by = self.plan.by_name()
        members = atomic_groups(self.plan)
        unit_of_name = {n: k for k, ns in members.items() for n in ns}
        pending: dict[tuple, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, x in items:
            for hf, y in self.names.to_hf(name, x):
                if hf in seen:
                    raise WeightUpdateError(f"weight '{hf}' was sent twice in one update")
                seen.add(hf)
                key = unit_of_name[hf]
                pending.setdefault(key, {})[hf] = y
                if set(pending[key]) == members[key]:
                    got = pending.pop(key)
                    yield [(by[n], got[n]) for n in sorted(got, key=lambda n: self._order[n])]
        missing = sorted(n for k in pending for n in members[k] - set(pending[k]))
        if pending:
            raise WeightUpdateError(f"incomplete atomic group(s): {', '.join(missing[:4])} never arrived",
                                    "fused siblings and share-scale groups must all be sent in one update")
        if len(seen) != len(by):  # a lone tensor missing: the rollout would keep a stale copy of it
            absent = [t.hf_name for t in self.plan.tensors if t.hf_name not in seen]
            raise WeightUpdateError(f"incomplete state dict: {len(absent)} of {len(by)} plan tensors never arrived, "
                                    f"e.g. {', '.join(absent[:3])}", "an update must carry every weight of the plan")

    def quantize_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """The quantized checkpoint tensors, one atomic unit at a time (NaN/Inf checked per unit; see send for the
        all-before-send guarantee)."""
        for unit in self._atomic_units(items):
            out: dict[str, torch.Tensor] = {}
            # share-scale groups inside the unit are quantized together; the rest one by one
            groups: dict[str, list] = {}
            for t, x in unit:
                g = self._groups.get(t.hf_name) if needs_shared_amax(t) else None
                groups.setdefault(g.id if g else t.hf_name, []).append((t, x))
            for members in groups.values():
                out.update(checkpoint_tensors(members, backend="weight_update"))
            yield out

    # -- GPU update program (backends/update_program.py) ------------------------------------------------------------
    def program(self):
        """The plan's update compiled into buckets of grouped launches (built once per sender)."""
        if getattr(self, "_program", None) is None:
            from precision_dsl.backends.update_program import UpdateProgram

            members = atomic_groups(self.plan)
            by = self.plan.by_name()
            units = [[by[n] for n in sorted(ns, key=self._order.__getitem__)] for ns in members.values()]
            units.sort(key=lambda u: self._order[u[-1].hf_name])
            prog = UpdateProgram(self.plan, units, self.bucket_bytes)
            if len(prog.buckets) < self.min_buckets:
                # a small model in a few large buckets leaves nothing to overlap: the first bucket's quantization
                # and the last one's transfer run alone. Smaller buckets (not below 32 MiB) deepen the pipeline.
                size = max(32 << 20, -(-prog.bytes // self.min_buckets))
                if size < self.bucket_bytes:
                    prog = UpdateProgram(self.plan, units, size)
            self._program = prog
        return self._program

    def prepare_program(self, items: Iterable[tuple[str, torch.Tensor]]) -> "PreparedUpdate":
        """Bind the trainer's weights once (names mapped, segments stacked - zero-copy where the weights are views
        of grouped buffers) so that every later `send(prepared)` only launches kernels. The binding holds views
        of the weights: valid while the trainer updates them in place (as optimizers do). Refuses, with nothing
        sent, exactly what the per-unit path refuses before sending: duplicates, names outside the plan, missing
        tensors, wrong shapes (NaN/Inf is counted on the GPU during the update; see _send_program). `prepare`
        picks this itself for CUDA weights on a GPU-buffer transport."""
        by = self.plan.by_name()
        hf: dict = {}
        for name, x in list(items):
            for n, y in self.names.to_hf(name, x):
                if n in hf:
                    raise WeightUpdateError(f"weight '{n}' was sent twice in one update")
                if n not in by:
                    raise WeightUpdateError(f"weight '{n}' is not in the plan",
                                            "an update must carry exactly the plan's weights")
                t = by[n]
                if tuple(y.shape) != tuple(t.shape):
                    raise WeightUpdateError(f"tensor '{n}' has shape {tuple(y.shape)}, the plan says {t.shape}")
                hf[n] = y
        if len(hf) != len(by):  # a lone tensor missing: the rollout would keep a stale copy of it
            absent = [t.hf_name for t in self.plan.tensors if t.hf_name not in hf]
            raise WeightUpdateError(f"incomplete state dict: {len(absent)} of {len(by)} plan tensors never arrived, "
                                    f"e.g. {', '.join(absent[:3])}", "an update must carry every weight of the plan")
        return PreparedUpdate(self.program().bind(hf), hf)

    def _fast_ok(self, items: list) -> bool:
        """CUDA weights, a transport that takes GPU buffers, Triton available: the GPU update program."""
        if self.gpu_program is False or not getattr(self.transport, "gpu_program", False):
            return False
        if not items or not all(getattr(x, "is_cuda", False) for _, x in items):
            return False
        from precision_dsl import kernels

        return kernels.available()

    def prepare(self, items: Iterable[tuple[str, torch.Tensor]]):
        """Everything that can refuse an update, with nothing sent: names, completeness against the plan (every
        tensor, no extras, no duplicates), quantization and the finite checks. Per-unit path: a list of quantized
        units (memory: the quantized model, <= the BF16 size, held once). CUDA weights on a GPU-buffer transport:
        a PreparedUpdate binding for the GPU update program (checked the same way; NaN/Inf there is counted on the
        GPU while the buckets move, and the update is aborted on both ends before the closing message)."""
        items = list(items)
        if self._fast_ok(items):
            return self.prepare_program(items)
        return list(self.quantize_all(items))

    def send(self, items, weight_version: Optional[str] = None) -> SendReport:
        """prepare() then send_prepared(): a refused update never opens the transport. `items`: (name, tensor)
        pairs or the result of prepare()."""
        if isinstance(items, PreparedUpdate):
            return self.send_prepared(items, weight_version)
        return self.send_prepared(self.prepare(items), weight_version)

    def _abort(self, err: BaseException, buckets: int, weight_version: Optional[str]):
        served = None
        abort = getattr(self.transport, "abort", None)
        if abort is not None:
            try:
                served = abort(f"{type(err).__name__}: {err}"[:500])
            except Exception:  # the transport is already broken; the original error is the one to report
                pass
        if not isinstance(err, Exception):  # KeyboardInterrupt & co. stay what they are
            raise err
        raise WeightUpdateAborted(f"weight update {weight_version or ''} aborted after {buckets} "
                                  f"bucket(s): {err}", getattr(err, "hint", ""), served_version=served) from err

    def _send_program(self, prep: "PreparedUpdate", weight_version: Optional[str]) -> SendReport:
        prog = self.program()
        plan_hash = _plan_hash(self.plan)
        if hasattr(self.transport, "weight_version"):
            self.transport.weight_version = weight_version
        self.transport.open(plan_hash)
        try:
            if hasattr(self.transport, "send_layout"):
                self.transport.send_layout(prog.metas)
            # fingerprints always on: they are the GPU buckets' checksums (the receiver always verifies them).
            # Every word with check_equal; else sampled (1/16 of each bucket): reading all the wire bytes once more
            # on each end was a third of a BF16 update's GPU time on one H200 (issue 12)
            stride = 1 if self.check_equal else SAMPLED_FINGERPRINT_STRIDE
            bad, fps = prog.run(prep.bound, lambda k, meta, buf: self.transport.send_gpu_bucket(meta, buf),
                                check_equal=True, fingerprint_stride=stride)
            n_bad = int(bad.item())  # the update's one host synchronisation
            if n_bad:  # every bucket has moved; abort instead of closing: receivers discard them
                raise NonFiniteWeight(_first_nonfinite(self.plan, prep.tensors) or "?", n_bad)
            report = SendReport(plan_hash=plan_hash, buckets=len(prog.buckets), tensors=prog.tensors,
                                bytes=prog.bytes, bucket_names=prog.bucket_names)
            self.transport.close({"plan_hash": plan_hash, "tensors": prog.tensors, "bytes": prog.bytes,
                                  "weight_version": weight_version, "digests": None,
                                  "fingerprints": fps.tolist(), "fingerprint_stride": stride})
        except BaseException as err:
            self._abort(err, len(prog.buckets), weight_version)
        return report

    def send_prepared(self, units, weight_version: Optional[str] = None) -> SendReport:
        """Bucket and send prepared units (or a GPU-program binding). All or nothing: any failure after the
        transport is opened is followed by `transport.abort(reason)` (receivers discard what they got; the SGLang
        client closes the bracket and rolls back) and raised as WeightUpdateAborted naming the version the consumer
        serves afterwards."""
        if isinstance(units, PreparedUpdate):
            return self._send_program(units, weight_version)
        plan_hash = _plan_hash(self.plan)
        report = SendReport(plan_hash=plan_hash)
        if hasattr(self.transport, "weight_version"):
            self.transport.weight_version = weight_version
        self.transport.open(plan_hash)
        try:
            self._send_units(units, report, plan_hash, weight_version)
        except BaseException as err:
            self._abort(err, report.buckets, weight_version)
        return report

    def _send_units(self, units, report: SendReport, plan_hash: str, weight_version) -> None:
        bucket: dict[str, torch.Tensor] = {}
        size = 0

        def flush():
            nonlocal bucket, size
            if not bucket:
                return
            meta, buf = pack_bucket(bucket)
            self.transport.send_bucket(meta, bucket, buf)
            report.buckets += 1
            report.bucket_names.append(list(bucket))
            bucket, size = {}, 0

        for unit in units:
            nb = sum(t.numel() * t.element_size() for t in unit.values())
            if bucket and size + nb > self.bucket_bytes:
                flush()
            bucket.update(unit)
            size += nb
            report.tensors += len(unit)
            report.bytes += nb
            if self.check_equal:
                report.digests.update({n: _digest(t) for n, t in unit.items()})
        flush()
        self.transport.close({"plan_hash": plan_hash, "tensors": report.tensors, "bytes": report.bytes,
                              "weight_version": weight_version,
                              "digests": report.digests if self.check_equal else None})


def layout_index(metas: list) -> tuple:
    """([{name: i} per bucket], {name: bucket number}) of GPU-program bucket layouts (dict(zip) / dict.fromkeys
    run at C speed)."""
    idxs = [dict(zip(m["names"], range(len(m["names"])))) for m in metas]
    where: dict = {}
    for k, m in enumerate(metas):
        where.update(dict.fromkeys(m["names"], k))
    return idxs, where


def _copy_layout(metas: list) -> list:
    """A copy of bucket layouts that later changes to the sender's objects cannot reach (the in-process transport
    hands over the sender's own dicts); elements are shared, so comparing with the next update's layouts is mostly
    identity checks."""
    return [{k: ([list(x) for x in v] if k == "shapes" else list(v) if isinstance(v, list) else v)
             for k, v in m.items()} for m in metas]


class _BucketViews(dict):
    """{name: tensor} over received GPU-program buckets; each view is made when first looked up (a 30B-parameter
    NVFP4 update carries ~75k checkpoint tensors: building them all eagerly costs more than moving the bytes)."""

    def __init__(self, metas: list, bufs: list, index: Optional[tuple] = None):
        super().__init__()
        idxs, self._where = index if index is not None else layout_index(metas)  # _where: name -> bucket number
        self._buckets: list = list(zip(metas, bufs, idxs))  # (meta, buf, {name: i})

    def update_from(self, other: dict) -> None:
        self._where = dict(self._where)  # the index may be shared with the receiver's cached layout
        self._where.update(dict.fromkeys(other, -1))
        super().update(other)

    def spec(self, n) -> tuple[str, tuple]:
        """(dtype name, shape) of `n` without making its view."""
        b = self._where[n]
        if b < 0:
            x = dict.__getitem__(self, n)
            return str(x.dtype).replace("torch.", ""), tuple(x.shape)
        meta, _buf, idx = self._buckets[b]
        i = idx[n]
        return meta["dtypes"][i], tuple(meta["shapes"][i])

    def _make(self, n):
        meta, buf, idx = self._buckets[self._where[n]]
        i = idx[n]
        off, nb = meta["offsets"][i], meta["nbytes"][i]
        v = buf[off:off + nb].view(_dtypes()[meta["dtypes"][i]]).reshape(meta["shapes"][i])
        dict.__setitem__(self, n, v)
        return v

    def __getitem__(self, n):
        if dict.__contains__(self, n):
            return dict.__getitem__(self, n)
        if n in self._where:
            return self._make(n)
        raise KeyError(n)

    def get(self, n, default=None):
        return self[n] if n in self._where else default

    def __contains__(self, n) -> bool:
        return n in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self):
        return iter(self._where)

    def keys(self):
        return self._where.keys()

    def items(self):
        return ((n, self[n]) for n in self._where)

    def values(self):
        return (self[n] for n in self._where)


@dataclass
class PreparedUpdate:
    """Trainer weights bound to a sender's GPU update program (WeightSender.prepare)."""

    bound: object
    tensors: dict


def _first_nonfinite(plan: Plan, tensors: dict) -> Optional[str]:
    import torch

    for t in plan.tensors:
        x = tensors.get(t.hf_name)
        if x is not None and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            return t.hf_name
    return None


SAMPLED_FINGERPRINT_STRIDE = 16  # a GPU-program sender without check_equal digests every 16th 32 KB block


class WeightReceiver:
    """Receiving end for InProcessTransport / TorchDistributedTransport."""

    def __init__(self, plan: Plan, transport, check_equal: bool = True):
        self.plan, self.transport, self.check_equal = plan, transport, check_equal
        self.raw: dict[str, torch.Tensor] = {}
        self.summary: Optional[dict] = None
        # (bucket metas, their index) of the last GPU-program layout that passed _check_complete: a rollout keeps
        # one receiver, and the program sends the same layout every update, so its per-tensor check (~75k
        # checkpoint tensors for a 30B NVFP4 model) is done once, not on every update
        self._layout: Optional[tuple] = None

    def receive_raw(self, timeout: Optional[float] = 600) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors (X.weight, X.weight_scale_inv, ...) exactly as sent."""
        self.transport.handshake(_plan_hash(self.plan))
        self.raw = {}
        bufs: list = []
        metas: list = []
        while True:
            kind, meta, buf = self.transport.recv(timeout=timeout) if isinstance(self.transport, InProcessTransport) \
                else self.transport.recv()
            if kind == "abort":
                self.raw = {}
                raise WeightUpdateAborted(f"the sender aborted the update: {meta.get('reason')}")
            if kind == "close":
                self.summary = meta
                break
            if "offsets" in meta:  # GPU program layout: views made on first access, not per tensor here
                bufs.append(buf)
                metas.append(meta)
                continue
            try:
                self.raw.update(unpack_bucket(meta, buf))
            except WeightUpdateError:
                self._drain(timeout)  # keep the stream in step: the next update starts at its own 'open'
                self.raw = {}
                raise
        program_only = bool(metas) and not self.raw  # every tensor came in GPU-program buckets
        # the same layout as an update already checked (list equality: identity first, then by value)
        known = program_only and self._layout is not None and self._layout[0] == metas
        if metas:
            index = self._layout[1] if known else layout_index(metas)
            lazy = _BucketViews(metas, bufs, index)
            if self.raw:
                lazy.update_from(self.raw)
            self.raw = lazy
        try:
            if bufs:
                self._check_fingerprints(bufs)
            if self.summary.get("tensors") != len(self.raw):
                raise WeightUpdateMismatch(f"received {len(self.raw)} tensors, "
                                           f"the sender sent {self.summary.get('tensors')}")
            if not known:
                self._check_complete()
        except WeightUpdateError:
            self.raw = {}
            raise
        if program_only and not known:
            self._layout = (_copy_layout(metas), index)
        digests = self.summary.get("digests")
        if self.check_equal and digests:
            bad = sorted(n for n, d in digests.items() if n not in self.raw or _digest(self.raw[n]) != d)
            if bad:
                raise WeightUpdateMismatch(f"{len(bad)} tensor(s) differ between sender and receiver, e.g. {bad[0]}")
        return self.raw

    def _drain(self, timeout) -> None:
        while True:
            kind, _meta, _buf = self.transport.recv(timeout=timeout) if isinstance(self.transport,
                                                                                 InProcessTransport) \
                else self.transport.recv()
            if kind in ("close", "abort"):
                return

    def _check_fingerprints(self, bufs: list) -> None:
        """GPU-program buckets: the on-GPU fingerprints the sender computed after filling each bucket (always sent)
        must match the bytes that arrived - their per-bucket checksum."""
        import torch

        from precision_dsl.kernels import triton_segments

        fps = self.summary.get("fingerprints")
        stride = self.summary.get("fingerprint_stride", 1)
        if not isinstance(fps, list) or not isinstance(stride, int) or stride < 1:
            raise WeightUpdateMismatch("GPU-program buckets arrived without fingerprints",
                                       "sender and receiver must run the same policyc")
        if self.check_equal and stride != 1:
            raise WeightUpdateMismatch(f"the sender fingerprinted 1/{stride} of each bucket, this receiver checks "
                                       "every byte (check_equal=True)", "create the WeightSender with "
                                       "check_equal=True too, or the receiver with check_equal=False")
        mine = torch.zeros(len(bufs), dtype=torch.int64, device=bufs[0].device)
        for k, b in enumerate(bufs):
            triton_segments.fingerprint(b, mine[k:k + 1], stride)
        bad = [k for k, (x, y) in enumerate(zip(mine.tolist(), fps)) if x != y]
        if bad or len(bufs) != len(fps):
            raise WeightUpdateMismatch(f"bucket(s) {bad or 'count'} differ between sender and receiver "
                                       "(on-GPU fingerprints)")

    def _check_complete(self) -> None:
        """Exactly the plan's checkpoint tensors, with the plan's dtypes and shapes: nothing missing, nothing
        extra, so an update is applied whole or not at all."""
        from precision_dsl.backends.quantize import output_specs
        from precision_dsl.backends.safetensors_io import _TORCH_DT

        want = {n: (dt, tuple(sh)) for t in self.plan.tensors for n, dt, sh in output_specs(t)}
        missing = sorted(set(want) - set(self.raw))
        extra = sorted(set(self.raw) - set(want))
        if missing or extra:
            raise WeightUpdateMismatch(f"update does not match the plan: {len(missing)} tensor(s) missing (e.g. "
                                       f"{missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
        spec = getattr(self.raw, "spec", None)  # lazy GPU-program views: dtype/shape from the bucket layout
        for n, (dt, sh) in want.items():
            if spec is not None:
                got_dt, got_sh = spec(n)
            else:
                x = self.raw[n]
                got_dt, got_sh = str(x.dtype).replace("torch.", ""), tuple(x.shape)
            if got_dt != _TORCH_DT[dt] or got_sh != sh:
                raise WeightUpdateMismatch(f"tensor '{n}' arrived as {got_dt} {got_sh}, the plan says {dt} {sh}")

    def receive(self, timeout: Optional[float] = 600) -> dict:
        """{hf_name: QuantizedTensor | Tensor} for every plan tensor."""
        raw = self.receive_raw(timeout)
        from precision_dsl.backends.quantize import output_specs

        out = {}
        for t in self.plan.tensors:
            names = [n for n, _, _ in output_specs(t)]
            missing = [n for n in names if n not in raw]
            if missing:
                raise WeightUpdateMismatch(f"tensor '{missing[0]}' of plan tensor '{t.hf_name}' was not received")
            out[t.hf_name] = read_quantized(t, {n: raw[n] for n in names})
        return out


# ---------------------------------------------------------------------------------------------------------------
# the registered backend (backends/registry.py): the manifest emitter above and its reading
# ---------------------------------------------------------------------------------------------------------------
from precision_dsl.backends.registry import Backend, EmitOptions, register_backend  # noqa: E402


@register_backend
class WeightUpdateBackend(Backend):
    name = "weight_update"
    description = "the live weight update: per Megatron parameter the rollout tensors it sends, atomic groups, buckets"

    def emit(self, plan: Plan, options: EmitOptions, problems) -> list:
        return problems.run(emit, plan, bucket_bytes=options.bucket_bytes) or []

    def derive_formats(self, artifacts, arch) -> dict[str, str]:
        """The rollout's weight formats from the tensors weight_update/manifest.json says the update sends (read
        like the converter's checkpoint: the receiver loads the same tensors)."""
        from precision_dsl.backends.common import read_json_artifact
        from precision_dsl.backends.converter import derive_formats_from_specs

        doc = read_json_artifact(artifacts, "weight_update/manifest.json")
        specs = {n: dt for p in (doc.get("params") or {}).values() for n, dt, _ in p["outputs"]}
        return derive_formats_from_specs(specs, arch)
