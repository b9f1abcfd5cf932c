"""Transports: how buckets move from the sender to the receiver.

  InProcessTransport            a queue (sender and receiver in one process; used by the embedded RL engine)
  TorchDistributedTransport     broadcast from `src` over a torch.distributed group (gloo on CPU, NCCL on GPU)
  SGLangHTTPTransport           SGLang 0.5.23 HTTP: begin_weight_update -> update_weights_from_tensor or
                                update_weights_from_distributed (per bucket) -> end_weight_update (endpoints and
                                bodies: sglang 0.5.23 python/sglang/srt/entrypoints/http_server.py and
                                python/sglang/srt/managers/io_struct.py)

Sender side: open(plan_hash), send_bucket(meta, tensors, buf) / send_layout + send_gpu_bucket (GPU update program),
close(summary), abort(reason). Receiver side: handshake(plan_hash), recv() -> (kind, meta, buf).
"""

from __future__ import annotations

import base64
import http.client
import json
import queue
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from precision_dsl.backends.common import PLAN_FILE, PlanMismatch
from precision_dsl.backends.weight_update.buckets import declared_size
from precision_dsl.backends.weight_update.errors import WeightUpdateError, WeightUpdateMismatch

if TYPE_CHECKING:
    import torch



def json_call(engine: str, base_url: str, method: str, path: str, body: Optional[dict], timeout: float,
              not_found_hint: str = "") -> dict:
    """One JSON request to a rollout server's HTTP API: every transport failure is a WeightUpdateError naming the
    engine and the route; the reply is parsed with a size bound (a dict, {} for anything else)."""
    from precision_dsl.jsonsafe import loads_bounded

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        raise WeightUpdateError(f"{engine} {path} returned HTTP {err.code}: {err.read()[:300]!r}",
                                not_found_hint if err.code == 404 else "") from None
    except urllib.error.URLError as err:
        raise WeightUpdateError(f"cannot reach {engine} at {base_url}: {err.reason}",
                                "is the server running? check the URL/port") from None
    except (OSError, http.client.HTTPException) as err:  # reset, timeout, truncated response
        raise WeightUpdateError(f"{engine} {path}: connection failed ({type(err).__name__}: {err})") from None
    out = loads_bounded(raw, f"{engine} {path} response", WeightUpdateError, max_bytes=16 << 20) if raw else {}
    return out if isinstance(out, dict) else {}

def verify_served_plan(server: str, model_path, plan_hash: str, allow_unverified: bool, hint: str) -> Optional[str]:
    """The hash handshake on the checkpoint a rollout server serves: its PLAN_FILE (written by `policyc convert`)
    must hold this plan, else PlanMismatch naming `server`. Returns the verified model path; None when the server
    names no checkpoint with a readable PLAN_FILE and `allow_unverified` lets the update go on (else PlanMismatch
    with `hint`)."""
    plan_file = Path(str(model_path)) / PLAN_FILE if model_path else None
    if plan_file is None or not plan_file.is_file():
        if not allow_unverified:
            raise PlanMismatch(server, plan_hash, None, hint=hint)
        return None
    try:
        from precision_dsl.backends.converter import read_plan

        got = read_plan(plan_file.parent).content_hash()
    except ValueError:  # CheckpointError: unreadable / not a plan
        got = None
    if got != plan_hash:
        raise PlanMismatch(f"{server} (serving {model_path})", plan_hash, got)
    return str(model_path)


class InProcessTransport:
    """A queue between a sender and a receiver in the same process (or threads)."""

    gpu_program = True  # CUDA senders take the GPU update program (copy stream, see send_gpu_bucket)

    def __init__(self, persistent: bool = False, direct: bool = True):
        """persistent: GPU buckets land in receiver buffers kept from one update to the next (bucket k of every
        update overwrites the same memory, as a rollout engine updates its weights in place; views received
        earlier then show the new weights; receive each update before the next is sent). Default: fresh
        buffers per update.

        direct (persistent only; the colocated case: trainer and rollout on one GPU): the GPU update program
        writes each bucket straight into the receiver's buffer (`gpu_destination`), so a bucket costs no pool
        buffer and no second copy; send_gpu_bucket then only passes the message. direct=False keeps the copy
        stream (the sender fills its own double buffers, a copy moves them; for the side-by-side benchmark).

        Either way a persistent receiver's weights are overwritten while the update is under way: an update that
        is aborted after that (NaN/Inf counted on the GPU, a failure part-way) leaves them torn; the abort says so
        and the receiver then refuses to serve them until a complete update lands (WeightReceiver.stale)."""
        # SimpleQueue: the C queue (put / get with timeout / empty), a few times cheaper per message than
        # queue.Queue's Condition, and an update passes a message per bucket
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self.persistent = persistent
        self.direct = bool(persistent and direct)
        self._dst: dict = {}
        self._dst_meta: dict = {}
        self._k = 0
        self._overwritten = False  # a persistent receiver buffer was (or is being) written since open()
        self._filled_on = None  # the device buckets were filled in place on (direct mode), for close's event

    # sender side
    def open(self, plan_hash: str) -> None:
        self._k = 0
        self._overwritten = False
        self._filled_on = None  # the device buckets were filled in place on (direct mode), for close's event
        self._q.put(("open", {"plan_hash": plan_hash}, None, None))

    def send_bucket(self, meta: dict, tensors: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
        self._q.put(("bucket", meta, buf.clone(), None))

    def _buffer(self, k: int, like: torch.Tensor) -> torch.Tensor:
        import torch

        dst = self._dst.get(k) if self.persistent else None
        if dst is None or dst.numel() != like.numel() or dst.device != like.device:
            dst = torch.empty_like(like)
            if self.persistent:
                self._dst[k] = dst
        if self.persistent:
            self._overwritten = True
        return dst

    def gpu_destination(self, k: int, nbytes: int, device) -> Optional[torch.Tensor]:
        """Direct mode: the receiver-owned uint8 buffer of bucket k (nbytes, on `device`), kept across updates, for
        the program to fill in place; None when this transport copies (not persistent, or direct=False)."""
        if not self.direct:
            return None
        import torch

        dst = self._dst.get(k)
        hit = self._dst_meta.get(k)  # (buffer, nbytes, device) of the last call: no tensor attribute read per bucket
        if dst is None or hit is None or hit[0] is not dst or hit[1] != nbytes or hit[2] != device:
            device = torch.device(device)
            if dst is None or dst.numel() != nbytes or dst.device != device:
                dst = self._dst[k] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._dst_meta[k] = (dst, nbytes, device)
        self._overwritten = True
        return dst

    def send_gpu_bucket(self, meta: dict, buf: torch.Tensor):
        """Hand a GPU bucket to the receiver. Direct mode with `buf` = this bucket's receiver buffer (filled in
        place): the message only, with an event that orders the receiver's stream after the filling work. Else
        copy it into a receiver-side buffer on a separate copy stream (ordered after the work that filled it), so
        the sender can fill the next bucket meanwhile. Returns a handle whose wait() makes the sender's stream
        wait for the copy before it reuses `buf` (None when nothing was copied); nothing blocks the host."""
        k = self._k
        self._k += 1
        own = self._dst.get(k) if self.direct else None
        if own is not None and (own is buf or (own.data_ptr() == buf.data_ptr() and own.numel() == buf.numel())):
            # filled in place: the receiver reads it only after 'close', whose one event orders its stream after
            # the filling of every bucket (no event per bucket: a 30B update has ~100 buckets). CPU buffers: the
            # Triton interpreter's runs of the program (tests)
            if self._filled_on is None and buf.is_cuda:
                self._filled_on = buf.device
            self._q.put(("bucket", meta, own, None))
            return None
        import torch

        on_gpu = buf.is_cuda
        if not on_gpu:
            dst = self._buffer(k, buf)
            dst.copy_(buf)
            self._q.put(("bucket", meta, dst, None))
            return None
        cur = torch.cuda.current_stream(buf.device)
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(buf.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            dst = self._buffer(k, buf)
            dst.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        dst.record_stream(cur)  # the receiver reads it on the current stream
        self._q.put(("bucket", meta, dst, ev))
        return _StreamWait(ev)

    def close(self, summary: dict) -> None:
        ev = None
        if self.direct:
            summary = dict(summary, direct=True)  # one memory: the receiver holds the sender's very bytes
            dev = self._filled_on
            if dev is not None:  # every bucket filled in place on the sender's stream: one event after them all
                import torch

                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                ev = (ev, dev)
                self._filled_on = None
        self._q.put(("close", summary, None, ev))

    @property
    def torn(self) -> bool:
        """The receiver's kept buffers were (partly) overwritten by the update under way."""
        return self._overwritten

    def abort(self, reason: str) -> None:
        # torn: the receiver's kept buffers were overwritten by this update, which is not complete
        self._q.put(("abort", {"reason": reason, "torn": self._overwritten}, None, None))

    # receiver side
    def recv(self, timeout: Optional[float] = None):
        kind, meta, buf, ev = self._q.get(timeout=timeout)
        if ev is not None:
            import torch

            ev, dev = ev if isinstance(ev, tuple) else (ev, buf.device)  # (event, device): 'close' carries no buffer
            torch.cuda.current_stream(dev).wait_event(ev)
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
        # double-buffered buckets). Off by default until it has run on a two-GPU machine.
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
            buf = torch.empty(declared_size(meta), dtype=torch.uint8, device=self.device)
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
        buf = torch.empty(declared_size(meta), dtype=torch.uint8, device=self.device)
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
        out = json_call("SGLang", self.base_url, method, path, body, self.timeout)
        if out.get("success") is False:
            raise WeightUpdateError(f"SGLang {path} failed: {str(out.get('message'))[:300]}")
        return out

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
        verified = verify_served_plan(f"SGLang server {self.base_url}", info.get("model_path"), plan_hash,
                                      self.allow_unverified,
                                      f"the served model_path has no readable {PLAN_FILE}; serve a `policyc convert` "
                                      "output or pass allow_unverified=True")
        if verified is not None:
            self._model_path = verified
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
