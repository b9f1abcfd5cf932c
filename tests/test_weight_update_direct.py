"""Direct (colocated) mode of the GPU update program: with InProcessTransport(persistent=True) the program writes
every bucket straight into the receiver's kept buffers (no pool buffer, no second copy).

Checked: the received tensors are views of the transport's own buffers, byte for byte what the converter's
`checkpoint_tensors` writes (and what the copying mode delivers), over several updates with the weights changed in
place (all of them, one expert only, none: the predicted NVFP4 kernel's every-group, one-group and no redo); small high-precision pieces share one launch per bucket (same bytes as a launch each); an update aborted
after it overwrote the buffers (NaN counted on the GPU) leaves the receiver STALE - receive_raw raises, the weights
it returned before refuse every lookup - until a complete update lands; without check_equal no fingerprint pass
runs (one memory) and a full-check receiver refuses that; with check_equal the sender's fingerprints, taken when
each bucket is filled, catch a bucket overwritten before the receiver looked (aliased receiver buffers).

On CPU the bf16, NVFP4 and MXFP8 byte cases run in a child process under Triton's interpreter (TRITON_INTERPRET=1;
the program's kernels, interpreted, with the hardware model of tests/kernels_interpreted.py); on CUDA (marked gpu) every case runs compiled, NVFP4 / MXFP8 / FP8-block included, with the
second and third updates replayed from CUDA graphs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import triton  # noqa: F401  (in the test extra: a missing interpreter fails, never skips)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_interpreted as ki  # noqa: E402  (the interpreted child runner and the hardware model)

GPU_POLICIES = ["bf16", "nvfp4-pertoken-dequant-backward", "mxfp8-e2e", "fp8-blockwise-hopper"]
VICTIM = "model.layers.3.mlp.experts.5.up_proj.weight"  # late in the update: earlier buckets already landed


def _setup(policy, dev):
    from test_weight_update_gpu import _plan, _reference  # noqa: F401

    from precision_dsl.arch import load_architecture

    import test_weight_update_gpu as base

    base.DEV = dev
    plan = _plan(policy)
    weights = base._weights(load_architecture("tiny-moe"), True)
    return plan, weights, base


def _same(raw, ref) -> list:
    return [n for n, r in ref.items() if n not in raw or raw[n].dtype != r.dtype
            or tuple(raw[n].shape) != tuple(r.shape)
            or not torch.equal(raw[n].cpu().reshape(-1).view(torch.uint8), r.cpu().reshape(-1).view(torch.uint8))]


def check_direct_bytes(policy: str, dev: str) -> dict:
    from precision_dsl.backends.weight_update import InProcessTransport, WeightReceiver, WeightSender

    plan, weights, base = _setup(policy, dev)
    tr = InProcessTransport(persistent=True)
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10, check_equal=True)
    prep = sender.prepare_program(weights.items())
    rx = WeightReceiver(plan, tr, check_equal=True)
    out = {}
    for step in range(5):
        with torch.no_grad():
            if step in (1, 2):
                for x in weights.values():
                    x.mul_(-1.5)  # the trainer's update, in place: every (NVFP4 group) amax moves
            elif step == 3:
                weights[VICTIM].mul_(2.0)  # one expert's amax moves, every other one's stays (predicted: one redo)
            # step 4: nothing changed (every predicted amax right)
        sender.send(prep)
        raw = rx.receive_raw()
        ref = base._reference(plan, weights)
        out[f"step{step}.bytes"] = not _same(raw, ref)
    # without check_equal nothing is fingerprinted per bucket: on CUDA the copies and the quantize launches then
    # run on two streams (UpdateProgram.run's lanes), eagerly on the first of these updates, from graphs after (on
    # CPU there is one stream: the steps above ran the same lanes one after the other)
    sender.check_equal = rx.check_equal = False

    def update(scale):
        """Scale every trainer weight in place (None: unchanged), update, and whether the bytes are the reference's."""
        nonlocal raw
        if scale is not None:
            with torch.no_grad():
                for x in weights.values():
                    x.mul_(scale)
        sender.send(prep)
        raw = rx.receive_raw()
        return not _same(raw, base._reference(plan, weights))

    for step in range(3 if dev == "cuda" else 0):
        out[f"lanes.step{step}.bytes"] = update(-1.5 if step == 1 else None)
    if dev == "cuda":  # two lanes exactly when something is quantized (a BF16 update is copies only)
        out["lanes"] = (prep.bound.quant_stream is not None) == sender.program().quantizes
        # from the second update on, the whole update replays as ONE graph (NVFP4 redo / roll on a third stream),
        # unless a bucket stays eager (a per-unit segment, whose reference code may synchronise with the host)
        eager = any(seg.kind == "ref" for b in sender.program().buckets for seg in b.segments)
        out["whole_graph"] = (prep.bound.whole is not None) != eager
        # a graph per bucket and lane instead (the side-by-side benchmark's "/bucket" modes): the same bytes
        prep.bound.whole_graph = False
        for step in range(2):
            out[f"bucket_graphs.step{step}.bytes"] = update(-1.25)
        out["bucket_graphs"] = prep.bound.graphs is not None
    ptrs = {b.data_ptr() for b in tr._dst.values()}
    out["views_of_receiver_buffers"] = all(raw[n].untyped_storage().data_ptr() in ptrs for n in list(raw)[:50])
    out["no_pool"] = prep.bound.pool is None
    out["buckets"] = len(tr._dst) == len(sender.program().buckets) > 2
    out["small_pieces_grouped"] = any(g is not None for g in prep.bound.hp_groups)
    quantized = {(k, si) for k, b in enumerate(sender.program().buckets) for si, seg in enumerate(b.segments)
                 if seg.kind in ("nvfp4", "mxfp8")}
    if quantized:  # every NVFP4 / MXFP8 segment in its bucket's one launch (kernels/triton_bucket.py)
        out["bucket_launches"] = all(si in prep.bound.bucket_launches[k][1] for k, si in quantized)
    # the same bytes with a launch per piece and through the copying mode (direct=False)
    tr2 = InProcessTransport(persistent=True, direct=False)
    s2 = WeightSender(plan, tr2, bucket_bytes=64 << 10, check_equal=True)
    p2 = s2.program().bind(prep.tensors, group_small=False)
    from precision_dsl.backends.weight_update import PreparedUpdate

    s2.send(PreparedUpdate(p2, prep.tensors))
    raw2 = WeightReceiver(plan, tr2, check_equal=True).receive_raw()
    out["copy_mode_same"] = not _same(raw2, {n: raw[n] for n in raw})
    out["copy_mode_pool"] = p2.pool is not None
    return out


def check_abort_leaves_receiver_stale(dev: str) -> dict:
    from precision_dsl.backends.quantize import NonFiniteWeight
    from precision_dsl.backends.weight_update import (InProcessTransport, WeightReceiver, WeightSender,
                                                      WeightUpdateAborted)

    plan, weights, base = _setup("bf16", dev)
    tr = InProcessTransport(persistent=True)
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10)
    prep = sender.prepare_program(weights.items())
    rx = WeightReceiver(plan, tr, check_equal=False)
    sender.send(prep)
    first = rx.receive_raw()
    name = next(iter(first))
    out = {"fresh": rx.stale is None and first[name] is not None}
    good = weights[VICTIM][3, 7].item()
    weights[VICTIM][3, 7] = float("nan")
    try:
        sender.send(prep)
        out["sender_raised"] = False
    except WeightUpdateAborted as err:
        out["sender_raised"] = isinstance(err.__cause__, NonFiniteWeight) and "overwritten in place" in err.hint
    try:
        rx.receive_raw()
        out["receiver_raised"] = False
    except WeightUpdateAborted as err:
        out["receiver_raised"] = "refused until a complete update lands" in str(err)
    out["stale"] = rx.stale is not None and rx.raw == {}
    try:
        first[name]
        out["old_views_refused"] = False
    except WeightUpdateAborted:
        out["old_views_refused"] = True
    weights[VICTIM][3, 7] = good
    sender.send(prep)
    raw = rx.receive_raw()
    out["recovered"] = rx.stale is None and not _same(raw, base._reference(plan, weights))
    return out


def check_fingerprints(dev: str) -> dict:
    from precision_dsl.backends.weight_update import (InProcessTransport, WeightReceiver, WeightSender,
                                                      WeightUpdateMismatch)

    plan, weights, _base = _setup("bf16", dev)
    out = {}
    tr = InProcessTransport(persistent=True)
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10)  # no check_equal: no fingerprint pass at all
    prep = sender.prepare_program(weights.items())
    sender.send(prep)
    rx = WeightReceiver(plan, tr, check_equal=False)
    rx.receive_raw()
    out["no_fingerprints"] = rx.summary.get("fingerprints") is None and rx.summary.get("direct") is True
    sender.send(prep)
    try:
        WeightReceiver(plan, tr, check_equal=True).receive_raw()
        out["full_check_refuses"] = False
    except WeightUpdateMismatch as err:
        out["full_check_refuses"] = "without fingerprints" in str(err)
    # check_equal: bucket 1's receiver buffer overlaps the tail of bucket 0's (an aliasing transport): bucket 0's
    # bytes are overwritten after the sender fingerprinted them
    tr = InProcessTransport(persistent=True)
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10, check_equal=True)
    prep = sender.prepare_program(weights.items())
    sizes = [b.nbytes for b in sender.program().buckets]
    arena = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    starts[1] -= 256

    def aliased(k, nbytes, device):
        tr._overwritten = True
        tr._dst[k] = arena[starts[k]:starts[k] + nbytes]
        return tr._dst[k]

    tr.gpu_destination = aliased
    sender.send(prep)
    try:
        WeightReceiver(plan, tr, check_equal=True).receive_raw()
        out["aliasing_caught"] = False
    except WeightUpdateMismatch as err:
        out["aliasing_caught"] = "fingerprints" in str(err)
    return out


CPU_CHECKS = {"direct_bytes[bf16]": lambda: check_direct_bytes("bf16", "cpu"),
              # the predicted NVFP4 segment kernel across updates, and MXFP8 members quantized in place
              "direct_bytes[nvfp4]": lambda: check_direct_bytes("nvfp4-pertoken-dequant-backward", "cpu"),
              "direct_bytes[mxfp8]": lambda: check_direct_bytes("mxfp8-e2e", "cpu"),
              "abort_stale": lambda: check_abort_leaves_receiver_stale("cpu"),
              "fingerprints": lambda: check_fingerprints("cpu")}


def test_direct_mode_interpreted():
    results = {r["case"]: r["checks"] for r in ki.interpreted_rows(__file__, timeout=1500,
                                                                   extra_env={"POLICYC_INTERPRET_SEGMENTS": "1"})}
    assert set(results) == set(CPU_CHECKS)
    bad = ki.failed_checks(results)
    assert not bad, bad



@pytest.mark.parametrize("policy", GPU_POLICIES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_bytes_gpu(policy):
    checks = check_direct_bytes(policy, "cuda")
    assert all(checks.values()), checks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_abort_leaves_receiver_stale_gpu():
    checks = check_abort_leaves_receiver_stale("cuda")
    assert all(checks.values()), checks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fingerprints_gpu():
    checks = check_fingerprints("cuda")
    assert all(checks.values()), checks


if __name__ == "__main__":  # the interpreter child
    ki.model_the_hardware()  # the interpreter's fp8 casts, bf16 widening and max as the H200's
    for case, fn in CPU_CHECKS.items():
        print(json.dumps({"case": case, "checks": fn()}), flush=True)
