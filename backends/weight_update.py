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
* NaN/Inf in any weight raises `NonFiniteWeight` before anything is sent.
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

from ..plan import Plan, TensorPlan

from .common import PLAN_FILE, PlanMismatch
from .common import plan_hash as _plan_hash
from .quantize import NonFiniteWeight, checkpoint_tensors, needs_shared_amax, read_quantized

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSender", "WeightReceiver", "InProcessTransport", "TorchDistributedTransport",
           "SGLangHTTPTransport", "megatron_to_hf", "gather_megatron_shards", "RankShard", "NonFiniteWeight",
           "PlanMismatch", "WeightUpdateMismatch", "WeightUpdateError", "SendReport"]


class WeightUpdateError(RuntimeError):
    code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class WeightUpdateMismatch(WeightUpdateError):
    """The receiver does not hold what the sender sent (equality check)."""


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
    return meta, buf


def unpack_bucket(meta: dict, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    import torch

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

    def __init__(self):
        self._q: "queue.Queue" = queue.Queue()

    # sender side
    def open(self, plan_hash: str) -> None:
        self._q.put(("open", {"plan_hash": plan_hash}, None))

    def send_bucket(self, meta: dict, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
        self._q.put(("bucket", meta, buf.clone()))

    def close(self, summary: dict) -> None:
        self._q.put(("close", summary, None))

    # receiver side
    def recv(self, timeout: Optional[float] = None):
        return self._q.get(timeout=timeout)

    def handshake(self, plan_hash: str) -> None:
        kind, meta, _ = self.recv(timeout=60)
        if kind != "open":
            raise WeightUpdateError(f"expected an 'open' message, got '{kind}'")
        if meta["plan_hash"] != plan_hash:
            raise PlanMismatch("weight update receiver", plan_hash, meta["plan_hash"])


class TorchDistributedTransport:
    """Broadcast over a torch.distributed process group from rank `src` (gloo on CPU, NCCL on GPU: tensors are moved
    to `device` before the collective). Every rank first all-gathers its plan hash, so all ranks refuse together."""

    def __init__(self, group=None, src: int = 0, device: str = "cpu"):
        self.group, self.src, self.device = group, src, device

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

    def close(self, summary: dict) -> None:
        self._bcast_obj(("close", summary))

    def recv(self, timeout: Optional[float] = None):
        import torch

        kind, meta = self._bcast_obj(None)
        if kind == "close":
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
                 allow_unverified: bool = False, timeout: float = 600.0):
        if mode not in ("tensor", "distributed"):
            raise ValueError("mode must be 'tensor' or 'distributed'")
        if mode == "distributed" and broadcast_fn is None:
            raise ValueError("mode='distributed' needs broadcast_fn(tensor) "
                             "(a torch.distributed broadcast from rank 0)")
        self.base_url = base_url.rstrip("/")
        self.mode, self.tp_size, self.selector, self.group_name = mode, tp_size, selector, group_name
        self.broadcast_fn, self.allow_unverified, self.timeout = broadcast_fn, allow_unverified, timeout
        self.weight_version: Optional[str] = None

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
        out = json.loads(raw) if raw else {}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightUpdateError(f"SGLang {path} failed: {out.get('message')}")
        return out

    def open(self, plan_hash: str) -> None:
        info = self._call("GET", "/get_model_info")
        path = Path(str(info.get("model_path", ""))) / PLAN_FILE
        if path.is_file():
            got = json.loads(path.read_text()).get("content_hash")
            if got != plan_hash:
                raise PlanMismatch(f"SGLang server {self.base_url} (serving {info.get('model_path')})", plan_hash, got)
        elif not self.allow_unverified:
            raise PlanMismatch(f"SGLang server {self.base_url}", plan_hash, None,
                               hint=f"the served model_path has no readable {PLAN_FILE}; serve a `policyc convert` "
                                    "output or pass allow_unverified=True")
        self._call("POST", "/begin_weight_update", {"selector": self.selector})

    def send_bucket(self, meta: dict, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
        if self.mode == "tensor":
            from multiprocessing.reduction import ForkingPickler
            import io

            bio = io.BytesIO()
            ForkingPickler(bio).dump(list(tensors.items()))
            payload = base64.b64encode(bio.getvalue()).decode()
            self._call("POST", "/update_weights_from_tensor",
                       {"serialized_named_tensors": [payload] * self.tp_size, "load_format": None,
                        "flush_cache": False, "weight_version": self.weight_version})
            return
        body = {"names": meta["names"], "dtypes": meta["dtypes"], "shapes": meta["shapes"],
                "group_name": self.group_name, "flush_cache": False, "weight_version": self.weight_version}
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

    def close(self, summary: dict) -> None:
        self._call("POST", "/end_weight_update", {})


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
    groups = {m: g for g in plan.share_scale_groups for m in g.members}

    def key(t: TensorPlan) -> tuple:
        g = groups.get(t.hf_name) if needs_shared_amax(t) else None
        if g is not None:
            return ("share", g.id)
        fi = t.fused_key
        return ("fused",) + fi if fi is not None else ("one", t.hf_name)

    need: dict[tuple, set[str]] = {}
    for t in plan.tensors:
        need.setdefault(key(t), set()).add(t.hf_name)
    parent = {k: k for k in need}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for t in plan.tensors:  # a share-scale group overlapping a fused instance (gate/up) joins it
        fi = t.fused_key
        if fi is not None and ("fused",) + fi in need:
            parent[find(key(t))] = find(("fused",) + fi)
    members: dict[tuple, set[str]] = {}
    for k, ns in need.items():
        members.setdefault(find(k), set()).update(ns)
    return members


def emit(plan: Plan, bucket_bytes: int = 512 << 20):
    """weight_update/manifest.json: per Megatron parameter, the HF tensors it becomes and the exact rollout tensors
    (name, dtype, shape) the update sends; the atomic groups; the bucket count at `bucket_bytes`."""
    from .common import Artifact, dump_json, plan_stamp
    from .quantize import check_all_supported, output_specs
    from .safetensors_io import DTYPE_SIZES

    check_all_supported(plan.tensors, "weight_update")
    params: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    prod = math.prod
    for t in plan.tensors:
        specs = output_specs(t)
        outs = [[n, dt, list(sh)] for n, dt, sh in specs]
        sizes[t.hf_name] = sum([DTYPE_SIZES[dt] * prod(sh) for _, dt, sh in specs])
        entry = params.get(t.megatron_name or t.hf_name)
        if entry is None:
            params[t.megatron_name or t.hf_name] = {"hf": [t.hf_name], "outputs": outs}
        else:
            entry["hf"].append(t.hf_name)
            entry["outputs"].extend(outs)
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
                 arch_config: Optional[dict] = None):
        self.plan, self.transport, self.bucket_bytes = plan, transport, int(bucket_bytes)
        self.check_equal = check_equal
        self.names = _NameMap(plan, arch_config)
        self._groups = {m: g for g in plan.share_scale_groups for m in g.members}
        self._order = {t.hf_name: i for i, t in enumerate(plan.tensors)}

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

    def send(self, items: Iterable[tuple[str, torch.Tensor]], weight_version: Optional[str] = None) -> SendReport:
        """Quantize everything first (so NaN/Inf or a missing tensor aborts before anything is sent), then bucket
        and send. Memory: the quantized model (<= the BF16 size) is held once."""
        plan_hash = _plan_hash(self.plan)
        units = list(self.quantize_all(items))
        report = SendReport(plan_hash=plan_hash)
        if hasattr(self.transport, "weight_version"):
            self.transport.weight_version = weight_version
        self.transport.open(plan_hash)
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
        return report


class WeightReceiver:
    """Receiving end for InProcessTransport / TorchDistributedTransport."""

    def __init__(self, plan: Plan, transport, check_equal: bool = True):
        self.plan, self.transport, self.check_equal = plan, transport, check_equal
        self.raw: dict[str, torch.Tensor] = {}
        self.summary: Optional[dict] = None

    def receive_raw(self, timeout: Optional[float] = 600) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors (X.weight, X.weight_scale_inv, ...) exactly as sent."""
        self.transport.handshake(_plan_hash(self.plan))
        while True:
            kind, meta, buf = self.transport.recv(timeout=timeout) if isinstance(self.transport, InProcessTransport) \
                else self.transport.recv()
            if kind == "close":
                self.summary = meta
                break
            self.raw.update(unpack_bucket(meta, buf))
        if self.summary.get("tensors") != len(self.raw):
            raise WeightUpdateMismatch(f"received {len(self.raw)} tensors, "
                                       f"the sender sent {self.summary.get('tensors')}")
        digests = self.summary.get("digests")
        if self.check_equal and digests:
            bad = sorted(n for n, d in digests.items() if n not in self.raw or _digest(self.raw[n]) != d)
            if bad:
                raise WeightUpdateMismatch(f"{len(bad)} tensor(s) differ between sender and receiver, e.g. {bad[0]}")
        return self.raw

    def receive(self, timeout: Optional[float] = 600) -> dict:
        """{hf_name: QuantizedTensor | Tensor} for every plan tensor."""
        raw = self.receive_raw(timeout)
        from .quantize import output_specs

        out = {}
        for t in self.plan.tensors:
            names = [n for n, _, _ in output_specs(t)]
            missing = [n for n in names if n not in raw]
            if missing:
                raise WeightUpdateMismatch(f"tensor '{missing[0]}' of plan tensor '{t.hf_name}' was not received")
            out[t.hf_name] = read_quantized(t, {n: raw[n] for n in names})
        return out
