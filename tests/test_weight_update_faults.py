"""Weight-update fault suite: an update is applied whole or not at all at every consumer.

* sender: an incomplete (any single tensor, fused or not) or over-complete state dict is refused before the
  transport is opened; a NaN, or a finite BF16 value an `fp16` rule overflows, is refused by name;
* in-process and torch.distributed (gloo, two real processes on localhost): a sender failing mid-update aborts,
  the receiver discards what it got, a corrupted bucket is caught by the always-on checksum, and the NEXT update on
  the same channel/group succeeds (no deadlock, no stale message);
* SGLang HTTP client against a stub that applies buckets in place like SGLang 0.5.23: a failure at any step
  (bucket k, end_weight_update, a dropped connection) ends with the bracket closed and the checkpoint reloaded from
  disk (or, if that fails too, the served version marked `incomplete:`); the server never reports the new version
  for a partial update;
* out-of-process rollout (gloo): after a refused update the next one goes through (the former deadlock).
"""

from __future__ import annotations

import functools
import http.server
import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from precision_dsl.backends import converter
from precision_dsl.backends.quantize import NonFiniteWeight
from precision_dsl.backends.synthetic import write_synthetic_checkpoint
from precision_dsl.backends.weight_update import (InProcessTransport, SGLangHTTPTransport, WeightReceiver, WeightSender,
                                    WeightUpdateAborted, WeightUpdateError, WeightUpdateMismatch)
from precision_dsl.arch import load_architecture
from precision_dsl.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
POLICY = REPO / "policies" / "mxfp8-e2e.policy"


@functools.lru_cache(maxsize=None)
def plan(path=str(POLICY)):
    return resolve(Path(path), load_architecture("tiny-moe"), None)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("wf")
    write_synthetic_checkpoint(load_architecture("tiny-moe"), d, shards=1, seed=5)
    return d


@pytest.fixture(scope="module")
def weights(src):
    return load_file(str(src / "model.safetensors"))


@pytest.fixture(scope="module")
def served(src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("served") / "ckpt"
    converter.convert(src, plan(), dst)
    return dst


def test_every_single_missing_tensor_is_refused_before_anything_is_sent(weights):
    """Not only fused siblings: drop each plan tensor in turn (a sample of every role)."""
    seen_roles: set = set()
    for t in plan().tensors:
        if t.role in seen_roles:
            continue
        seen_roles.add(t.role)
        w = {k: v for k, v in weights.items() if k != t.hf_name}
        tr = InProcessTransport()
        with pytest.raises(WeightUpdateError, match="never arrived"):
            WeightSender(plan(), tr).send(iter(w.items()))
        assert tr._q.empty(), t.hf_name  # not even the 'open'
    assert len(seen_roles) >= 8


@pytest.mark.parametrize("extra", [("model.layers.0.bogus.weight", torch.zeros(4)),
                                   ("model.norm.weight", None)], ids=["unknown", "duplicate"])
def test_over_complete_state_dict_is_refused(weights, extra):
    name, x = extra
    items = list(weights.items()) + [(name, weights[name] if x is None else x)]
    tr = InProcessTransport()
    with pytest.raises(WeightUpdateError, match="neither an HF nor a Megatron name|sent twice"):
        WeightSender(plan(), tr).send(iter(items))
    assert tr._q.empty()


def test_finite_bf16_that_overflows_fp16_is_refused_by_name(weights, tmp_path):
    p = tmp_path / "fp16.policy"
    p.write_text('policy "fp16" { default bf16\n norm: fp16 }\n')
    fp16_plan = resolve(p, load_architecture("tiny-moe"), None)
    w = dict(weights)
    w["model.layers.1.post_attention_layernorm.weight"] = torch.full_like(w["model.norm.weight"], 7e4)
    tr = InProcessTransport()
    with pytest.raises(NonFiniteWeight, match="post_attention_layernorm.*after the cast to fp16"):
        WeightSender(fp16_plan, tr).send(iter(w.items()))
    assert tr._q.empty()


class FailingAt(InProcessTransport):
    def __init__(self, k):
        super().__init__()
        self.k, self.n = k, 0

    def send_bucket(self, meta, tensors, buf):
        self.n += 1
        if self.n == self.k:
            raise ConnectionError("link down")
        super().send_bucket(meta, tensors, buf)


def test_in_process_abort_mid_update_then_next_update_succeeds(weights):
    tr = FailingAt(2)
    with pytest.raises(WeightUpdateAborted, match="link down"):
        WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()), weight_version="v1")
    rx = WeightReceiver(plan(), tr)
    with pytest.raises(WeightUpdateAborted, match="sender aborted"):
        rx.receive()
    assert rx.raw == {} and tr._q.empty()
    WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()), weight_version="v2")
    got = WeightReceiver(plan(), tr).receive_raw()
    assert len(got) > len(plan().tensors)


def test_corrupted_bucket_is_drained_and_the_next_update_succeeds(weights):
    class CorruptOnce(InProcessTransport):
        done = False

        def send_bucket(self, meta, tensors, buf):
            if not self.done:
                buf = buf.clone()
                buf[0] ^= 0x10
                self.done = True
            super().send_bucket(meta, tensors, buf)

    tr = CorruptOnce()
    WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()))
    WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()))
    with pytest.raises(WeightUpdateMismatch, match="arrived corrupted"):
        WeightReceiver(plan(), tr).receive()
    assert len(WeightReceiver(plan(), tr).receive_raw()) > 0 and tr._q.empty()


def _first_bf16_with_successor(meta: dict) -> Optional[int]:
    return next((i for i, dt in enumerate(meta["dtypes"][:-1]) if dt == "bfloat16"), None)


def _mutable(meta) -> dict:
    """A plain-dict, list-valued copy of a bucket layout (the update program's own are immutable FrozenLayouts), as
    a foreign or tampering sender would send it."""
    return {k: [list(x) for x in v] if k == "shapes" else list(v) if isinstance(v, (list, tuple)) else v
            for k, v in meta.items()}


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _odd_bf16(meta: dict) -> Optional[str]:
    """A BF16 tensor declared one byte short (its successor one byte long): the bucket's total still matches."""
    i = _first_bf16_with_successor(meta)
    if i is None:
        return None
    meta["nbytes"][i] -= 1
    meta["nbytes"][i + 1] += 1
    return meta["names"][i]


def _shape_disagrees(meta: dict) -> Optional[str]:
    """A shape with one row more than the tensor's bytes hold."""
    i = next((i for i, sh in enumerate(meta["shapes"]) if sh), None)
    if i is None:
        return None
    meta["shapes"][i][0] += 1
    return meta["names"][i]


def _past_the_end(meta: dict) -> Optional[str]:
    """The last tensor declared one row longer, shape and byte count consistent: its bytes run past the buffer."""
    sh = meta["shapes"][-1]
    if not sh:
        return None
    sh[0] += 1
    meta["nbytes"][-1] = math.prod(sh) * _itemsize(meta["dtypes"][-1])
    return meta["names"][-1]


TAMPER = {"odd-bf16": _odd_bf16, "shape": _shape_disagrees, "past-end": _past_the_end}


@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_bucket_whose_metadata_disagrees_with_its_bytes_is_refused_by_name(weights, tamper):
    """A bucket's meta (names, dtypes, shapes, byte counts) not matching its bytes - its checksum, taken over the
    bytes, still passes - is a WeightUpdateMismatch naming the tensor (not a RuntimeError from viewing or reshaping
    the bytes), and the stream stays in step: the next update on the same channel goes through."""
    class TamperOnce(InProcessTransport):
        bad: Optional[str] = None

        def send_bucket(self, meta, tensors, buf):
            if self.bad is None:
                meta = _mutable(meta)
                self.bad = TAMPER[tamper](meta)
            super().send_bucket(meta, tensors, buf)

    tr = TamperOnce()
    WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()))
    assert tr.bad is not None
    WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()))
    with pytest.raises(WeightUpdateMismatch, match=re.escape(f"'{tr.bad}'")):
        WeightReceiver(plan(), tr).receive()
    assert len(WeightReceiver(plan(), tr).receive()) == len(plan().tensors) and tr._q.empty()


def _program_offsets_odd_bf16(meta: dict) -> Optional[str]:
    i = _first_bf16_with_successor(meta)
    meta["nbytes"][i] -= 1
    return meta["names"][i]


def _program_offsets_short(meta: dict) -> Optional[str]:
    i = next(i for i, nb in enumerate(meta["nbytes"]) if nb >= 4)
    meta["nbytes"][i] -= 2
    return meta["names"][i]


def _program_offsets_past_end(meta: dict) -> Optional[str]:
    meta["offsets"][-1] += meta["total"]
    return meta["names"][-1]


PROGRAM_TAMPER = {"odd-bf16": _program_offsets_odd_bf16, "short": _program_offsets_short,
                  "past-end": _program_offsets_past_end}


@pytest.mark.parametrize("tamper", sorted(PROGRAM_TAMPER))
def test_gpu_program_layout_that_disagrees_with_its_buffer_is_refused_by_name(monkeypatch, tamper):
    """GPU-program buckets (a static layout: offsets into one buffer; their tensors are viewed lazily, when the
    rollout reads them) are checked against their buffers when the layout arrives, naming the tensor: a later
    view must not fail with a bare RuntimeError. Sent by hand (CPU buffers of zeros) with the sender's own
    program layout; the on-GPU fingerprint is stubbed (the layout check needs no GPU)."""
    from precision_dsl.kernels import triton_segments

    monkeypatch.setattr(triton_segments, "fingerprint", lambda buf, out, stride=1: None)
    metas = WeightSender(plan(), InProcessTransport()).program().metas

    def send(tr, metas):
        tr.open(plan().content_hash())
        for m in metas:
            tr._q.put(("bucket", m, torch.zeros(m["total"], dtype=torch.uint8), None))
        tr.close({"plan_hash": plan().content_hash(), "tensors": sum(len(m["names"]) for m in metas),
                  "bytes": sum(sum(m["nbytes"]) for m in metas), "weight_version": None, "digests": None,
                  "fingerprints": [0] * len(metas), "fingerprint_stride": 16})

    bad_metas = [_mutable(m) for m in metas]
    bad = PROGRAM_TAMPER[tamper](bad_metas[0])
    tr = InProcessTransport()
    rx = WeightReceiver(plan(), tr, check_equal=False)
    send(tr, bad_metas)
    with pytest.raises(WeightUpdateMismatch, match=re.escape(f"'{bad}'")):
        rx.receive()
    send(tr, metas)  # the same receiver takes the sender's true layout next
    assert len(rx.receive()) == len(plan().tensors) and tr._q.empty()


# ---------------------------------------------------------------------------------------------------------------
# torch.distributed (gloo) on localhost
# ---------------------------------------------------------------------------------------------------------------
def _gloo_faults(rank, port, src_dir, policy, out):
    import torch.distributed as dist

    from precision_dsl.backends.weight_update import TorchDistributedTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    log = []
    try:
        p = resolve(Path(policy), load_architecture("tiny-moe"), None)
        w = load_file(str(Path(src_dir) / "model.safetensors"))

        class Failing(TorchDistributedTransport):
            n = 0

            def send_bucket(self, meta, tensors, buf):
                Failing.n += 1
                if Failing.n == 2:
                    raise ConnectionError("trainer lost a bucket")
                super().send_bucket(meta, tensors, buf)

        class Corrupt(TorchDistributedTransport):
            def send_bucket(self, meta, tensors, buf):
                super().send_bucket(meta, tensors, torch.zeros_like(buf))

        scenarios = [("abort", Failing()), ("corrupt", Corrupt()), ("ok", TorchDistributedTransport())]
        for name, tr in scenarios:
            if rank == 0:
                try:
                    WeightSender(p, tr, bucket_bytes=1 << 16).send(iter(w.items()), weight_version=name)
                    log.append((name, "sent"))
                except WeightUpdateAborted as err:
                    log.append((name, f"aborted: {err}"[:80]))
            else:
                try:
                    got = WeightReceiver(p, TorchDistributedTransport()).receive_raw()
                    log.append((name, f"received {len(got)}"))
                except WeightUpdateError as err:
                    log.append((name, f"{type(err).__name__}"))
        with open(f"{out}.{rank}", "w") as f:
            json.dump(log, f)
    finally:
        dist.destroy_process_group()


def test_gloo_abort_and_corruption_then_next_update_on_the_same_group(src, tmp_path):
    import torch.multiprocessing as mp

    from tests_util_ports import free_port

    out = tmp_path / "log"
    ctx = mp.start_processes(_gloo_faults, args=(free_port(), str(src), str(POLICY), str(out)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.time() + 240
    while not ctx.join(timeout=5):
        assert time.time() < deadline, "weight-update fault suite hung (deadlock)"
    sender = dict(json.loads((tmp_path / "log.0").read_text()))
    receiver = dict(json.loads((tmp_path / "log.1").read_text()))
    assert sender["abort"].startswith("aborted") and receiver["abort"] == "WeightUpdateAborted"
    assert sender["corrupt"] == "sent" and receiver["corrupt"] == "WeightUpdateMismatch"
    assert sender["ok"] == "sent" and receiver["ok"].startswith("received ")


# ---------------------------------------------------------------------------------------------------------------
# SGLang HTTP: a stub that applies buckets in place, like SGLang 0.5.23
# ---------------------------------------------------------------------------------------------------------------
class StatefulStub:
    """`state` is what the server would generate with: 'checkpoint' + the names loaded in place since."""

    def __init__(self, model_path, fail=None):
        self.model_path, self.fail = str(model_path), dict(fail or {})
        self.version, self.loaded, self.calls, self.in_bracket = "checkpoint", set(), [], False
        stub = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                stub.calls.append(self.path)
                self._reply({"model_path": stub.model_path, "weight_version": stub.version})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stub.calls.append(self.path)
                n = stub.calls.count(self.path)
                mode = stub.fail.get((self.path, n))
                if mode == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if mode == "500":
                    return self._reply({"success": False, "message": "injected"}, 500)
                if self.path == "/begin_weight_update":
                    stub.in_bracket = True
                elif self.path == "/end_weight_update":
                    stub.in_bracket = False
                elif self.path == "/update_weights_from_distributed":
                    assert stub.in_bracket and body["weight_version"] is None
                    stub.loaded.update(body["names"])
                elif self.path == "/update_weights_from_disk":
                    stub.loaded, stub.version = set(), body["weight_version"]
                elif self.path == "/update_weight_version":
                    stub.version = body["new_version"]
                self._reply({"success": True, "message": "ok"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


FAULTS = {
    "bucket-3-500": {("/update_weights_from_distributed", 3): "500"},
    "bucket-2-drop": {("/update_weights_from_distributed", 2): "drop"},
    "end-fails": {("/end_weight_update", 1): "500"},
    "version-fails": {("/update_weight_version", 1): "500"},
    "rollback-fails-too": {("/update_weights_from_distributed", 2): "500", ("/update_weights_from_disk", 1): "500"},
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_sglang_failure_at_any_step_rolls_back_or_marks_incomplete(weights, served, fault, record_figure):
    stub = StatefulStub(served, FAULTS[fault])
    try:
        tr = SGLangHTTPTransport(stub.url, mode="distributed", broadcast_fn=lambda t: None, timeout=10)
        with pytest.raises(WeightUpdateAborted) as info:
            WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()), weight_version="v8")
    finally:
        stub.close()
    assert not stub.in_bracket and stub.version != "v8"  # never claims the partial update
    if fault == "rollback-fails-too":
        assert stub.version == "incomplete:v8" and info.value.served_version == "incomplete:v8"
    else:
        assert stub.loaded == set() and stub.version == f"checkpoint:{served}"
        assert info.value.served_version == f"checkpoint:{served}"


def test_sglang_success_reports_the_served_version(weights, served):
    stub = StatefulStub(served)
    try:
        tr = SGLangHTTPTransport(stub.url, mode="distributed", broadcast_fn=lambda t: None)
        WeightSender(plan(), tr, bucket_bytes=1 << 16).send(iter(weights.items()), weight_version="v9")
    finally:
        stub.close()
    assert stub.version == tr.served_version == "v9" and tr.previous_version == "checkpoint"
    assert stub.calls[-3:] == ["/end_weight_update", "/update_weight_version", "/model_info"]


# ---------------------------------------------------------------------------------------------------------------
# out-of-process rollout: no deadlock after a refused update
# ---------------------------------------------------------------------------------------------------------------
def test_remote_rollout_keeps_working_after_refused_updates(weights):
    from precision_dsl.engine.remote import RemoteRollout

    p = resolve(REPO / "policies" / "nvfp4-pertoken-dequant-backward.policy", load_architecture("tiny-moe"), None)
    rr = RemoteRollout(REPO / "precision_dsl" / "models" / "tiny-moe", p, trainer_device="cpu",
                       rollout_device="cpu")
    try:
        bad = dict(weights)
        bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
        with pytest.raises(NonFiniteWeight):
            rr.channel.send(bad)
        incomplete = {k: v for k, v in weights.items() if k != "model.norm.weight"}
        with pytest.raises(WeightUpdateError, match="never arrived"):
            rr.channel.send(incomplete)
        payload = rr.channel.send(weights)  # used to deadlock here
        rr.update_weights(payload)
        assert payload.version == 1 and rr.version == 1
        assert rr.received and set(rr.received) <= {t.hf_name for t in p.tensors}
    finally:
        rr.close()
