"""The GPU weight-update program (backends/update_program.py): grouped launches, byte for byte the converter's bytes.

Every received tensor must equal what `quantize.checkpoint_tensors` (the function `policyc convert` uses, here on
CPU with the readable references) writes for the same weights - for expert weights laid out back to back in one
buffer (zero-copy stacking, as Megatron's grouped experts) and as separate tensors (gather path). NaN/Inf found on
the GPU aborts the update on both ends. Runs on CUDA (marked gpu); `POLICYC_INTERPRET_SEGMENTS=1` with
TRITON_INTERPRET=1 runs the same checks on CPU through Triton's interpreter (development aid, slow).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import torch

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["nvfp4-pertoken-dequant-backward", "mxfp8-e2e", "bf16", "fp8-blockwise-hopper", "nvfp4-weight-only"]
_INTERP = os.environ.get("POLICYC_INTERPRET_SEGMENTS") == "1"

pytestmark = [] if _INTERP else [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")]
DEV = "cpu" if _INTERP else "cuda"


class _CpuTransport:
    """InProcessTransport stand-in for the interpreter run (no CUDA streams on CPU)."""

    def __init__(self):
        from precision_dsl.backends.weight_update import InProcessTransport

        self.inner = InProcessTransport()
        self.open, self.close, self.recv, self.handshake = (self.inner.open, self.inner.close, self.inner.recv,
                                                            self.inner.handshake)
        self.abort = self.inner.abort

    def send_gpu_bucket(self, meta, buf):
        self.inner._q.put(("bucket", meta, buf.clone(), None))


def _transport(persistent: bool = False):
    from precision_dsl.backends.weight_update import InProcessTransport

    return _CpuTransport() if _INTERP else InProcessTransport(persistent=persistent)


def _weights(arch, grouped: bool, seed: int = 0):
    """HF-named bf16 weights; grouped: each layer's expert gate/up live in one [E, 2N, K] buffer (Megatron fc1
    order: gate_e then up_e) and down in one [E, H, N] buffer, so the program stacks them without copies."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    by_layer: dict = {}
    for t in arch.tensors:
        if t.role.startswith("routed_experts.") and grouped:
            by_layer.setdefault((t.layer, t.role), []).append(t)
            continue
        x = torch.randn(t.shape, generator=g) * (0.02 if len(t.shape) == 2 else 1.0)
        out[t.hf_name] = x.to(torch.bfloat16).to(DEV)
    layers = sorted({k[0] for k in by_layer})
    for layer in layers:
        gates = sorted(by_layer[(layer, "routed_experts.gate")], key=lambda t: t.expert)
        ups = sorted(by_layer[(layer, "routed_experts.up")], key=lambda t: t.expert)
        downs = sorted(by_layer[(layer, "routed_experts.down")], key=lambda t: t.expert)
        n, k = gates[0].shape
        fc1 = (torch.randn((len(gates), 2 * n, k), generator=g) * 0.02).to(torch.bfloat16).to(DEV)
        fc2 = (torch.randn((len(downs),) + tuple(downs[0].shape), generator=g) * 0.02).to(torch.bfloat16).to(DEV)
        for e, (tg, tu, td) in enumerate(zip(gates, ups, downs)):
            out[tg.hf_name], out[tu.hf_name], out[td.hf_name] = fc1[e, :n], fc1[e, n:], fc2[e]
    return out


def _reference(plan, weights):
    """What the converter writes for these weights (CPU, reference quantizers), per unit."""
    from precision_dsl.backends.quantize import checkpoint_tensors, work_units

    by = plan.by_name()
    names = [t.hf_name for t in plan.tensors]
    ref = {}
    for unit in work_units(plan, names):
        ref.update(checkpoint_tensors([(by[n], weights[n].cpu()) for n in unit], backend="weight_update"))
    return ref


def _plan(policy):
    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    return resolve(ROOT / "policies" / f"{policy}.policy", load_architecture("tiny-moe"))


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_program_bytes_equal_converter_bytes(policy, grouped):
    from precision_dsl.backends.weight_update import WeightReceiver, WeightSender
    from precision_dsl.arch import load_architecture

    plan = _plan(policy)
    weights = _weights(load_architecture("tiny-moe"), grouped)
    tr = _transport(persistent=grouped)  # receiver buffers reused across updates in one of the two cases
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10, check_equal=True)  # small buckets: several, reused
    prog = sender.program()
    assert len(prog.buckets) > 2
    prep = sender.prepare_program(weights.items())
    expert_gathers = [g for b, gs in zip(prog.buckets, prep.bound.gather) for seg, g in zip(b.segments, gs)
                      if g is not None and seg.members[0].role.startswith("routed_experts.")]
    assert grouped == (not expert_gathers) or policy == "bf16"  # grouped experts are stacked without copies
    report = sender.send(prep if _INTERP else weights.items())  # on CUDA, send() picks the program itself
    raw = WeightReceiver(plan, tr, check_equal=True).receive_raw()
    if not _INTERP:  # the 2nd and 3rd updates replay per-bucket CUDA graphs: same bytes
        for _ in range(2):
            sender.send(prep)
            raw = WeightReceiver(plan, tr, check_equal=True).receive_raw()
        assert prep.bound.graphs is not None
    ref = _reference(plan, weights)
    assert set(raw) == set(ref) and report.tensors == len(ref)
    bad = [n for n, r in ref.items() if raw[n].dtype != r.dtype or tuple(raw[n].shape) != tuple(r.shape)
           or not torch.equal(raw[n].cpu().reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8))]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"
    # quantize segments really are grouped: far fewer segments than quantized tensors
    n_seg = sum(len(b.segments) for b in prog.buckets)
    if policy != "bf16":
        assert n_seg < len(plan.quantized())


@pytest.mark.parametrize("policy,value", [("nvfp4-pertoken-dequant-backward", float("nan")),
                                          ("mxfp8-e2e", float("inf")), ("mxfp8-e2e", float("nan")),
                                          ("fp8-blockwise-hopper", float("-inf"))])
def test_nonfinite_aborts_both_ends(policy, value):
    """NaN/Inf is counted on the GPU while the buckets move - by the quantize kernels themselves, in the pass that
    reads the weights (NVFP4's amax pass, MXFP8's and FP8-block's quantize pass); the sender then aborts instead of
    closing (the update protocol: a bad weight never lands): it raises WeightUpdateAborted caused by NonFiniteWeight,
    the receiver discards what it got."""
    from precision_dsl.backends.quantize import NonFiniteWeight
    from precision_dsl.backends.weight_update import WeightReceiver, WeightSender, WeightUpdateAborted
    from precision_dsl.arch import load_architecture

    plan = _plan(policy)
    weights = _weights(load_architecture("tiny-moe"), True)
    victim = "model.layers.2.mlp.experts.5.up_proj.weight"
    assert plan.by_name()[victim].precision.weight.is_quantized  # the victim goes through a quantize kernel
    weights[victim][3, 7] = value
    tr = _transport()
    sender = WeightSender(plan, tr)
    with pytest.raises(WeightUpdateAborted, match="experts.5.up_proj") as exc:
        sender.send(sender.prepare_program(weights.items()))
    assert isinstance(exc.value.__cause__, NonFiniteWeight)
    rx = WeightReceiver(plan, tr)
    with pytest.raises(WeightUpdateAborted, match="experts.5.up_proj"):
        rx.receive_raw()
    assert rx.raw == {}


def test_kept_receiver_checks_the_layout_once_and_still_refuses_a_changed_one():
    """A rollout keeps one WeightReceiver: the first update checks every checkpoint tensor's name, dtype and shape
    against the plan; later updates with the same bucket layouts skip that per-tensor pass (same bytes received),
    and a layout that differs - even by one shape - is checked again and refused."""
    from precision_dsl.backends.weight_update import WeightReceiver, WeightSender, WeightUpdateMismatch
    from precision_dsl.arch import load_architecture

    plan = _plan("mxfp8-e2e")
    weights = _weights(load_architecture("tiny-moe"), True)
    tr = _transport()
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10)
    prep = sender.prepare_program(weights.items())
    rx = WeightReceiver(plan, tr, check_equal=False)
    checks = []
    original = rx._check_complete
    rx._check_complete = lambda: (checks.append(1), original())[1]
    first = None
    for _ in range(3):
        sender.send(prep)
        raw = rx.receive_raw()
        got = {n: raw[n].cpu().clone() for n in raw}
        first = first or got
        assert set(got) == set(first) and all(torch.equal(got[n].view(torch.uint8).reshape(-1),
                                                          first[n].view(torch.uint8).reshape(-1)) for n in got)
    assert len(checks) == 1  # checked on the first update only
    frozen = sender.program().metas[0]
    with pytest.raises(TypeError, match="immutable"):  # the program's layouts cannot change in place
        frozen["total"] = 0
    meta = {k: [list(x) for x in v] if k == "shapes" else list(v) if isinstance(v, tuple) else v
            for k, v in frozen.items()}
    sender.program().metas[0] = meta  # a sender that changed its layout: a new, mutable one
    i = next(i for i, sh in enumerate(meta["shapes"]) if len(sh) == 2 and sh[0] != sh[1])
    shape = meta["shapes"][i]
    meta["shapes"][i] = shape[::-1]  # the same bytes, another shape
    sender.send(prep)
    with pytest.raises(WeightUpdateMismatch, match="the plan says"):
        rx.receive_raw()
    assert len(checks) == 2 and rx.raw == {}
    meta["shapes"][i] = [shape[0] + 1] + shape[1:]  # a layout its bytes do not fill: refused before the plan check
    sender.send(prep)
    with pytest.raises(WeightUpdateMismatch, match=f"'{meta['names'][i]}' is declared"):
        rx.receive_raw()
    assert len(checks) == 2 and rx.raw == {}


def test_sampled_fingerprints_catch_a_changed_bucket_and_a_full_check_receiver_refuses_them():
    """Without check_equal the sender digests every 16th 32 KB block of each bucket (and its last block): a word
    changed in transit inside a sampled block is caught; a receiver that asked for full checks refuses sampled
    digests instead of pretending it checked every byte."""
    from precision_dsl.backends.weight_update import WeightReceiver, WeightSender, WeightUpdateMismatch
    from precision_dsl.arch import load_architecture

    plan = _plan("mxfp8-e2e")
    weights = _weights(load_architecture("tiny-moe"), True)
    tr = _transport()
    sender = WeightSender(plan, tr, bucket_bytes=64 << 10)  # check_equal=False: sampled digests
    prep = sender.prepare_program(weights.items())
    sender.send(prep)
    WeightReceiver(plan, tr, check_equal=False).receive_raw()  # intact: accepted
    recv = tr.recv

    def flip_first_word(*a, **kw):
        kind, meta, buf = recv(*a, **kw)
        if kind == "bucket" and "offsets" in meta and meta is sender.program().metas[0]:
            buf.view(torch.int32)[0] ^= 1
        return kind, meta, buf

    tr.recv = flip_first_word
    sender.send(prep)
    with pytest.raises(WeightUpdateMismatch, match="fingerprints"):
        WeightReceiver(plan, tr, check_equal=False).receive_raw()
    tr.recv = recv
    sender.send(prep)
    with pytest.raises(WeightUpdateMismatch, match="1/16 of each bucket"):
        WeightReceiver(plan, tr, check_equal=True).receive_raw()


def test_segment_amax_of_bf16_equals_the_float_path():
    """The bf16 amax pass works on integer magnitude bits; for finite input its per-group amax bits equal the fp32
    (float compare) path's and torch's, zeros / subnormals / negative values / ties included, and both count the
    same non-finite elements."""
    from precision_dsl.kernels import triton_segments as ks

    g = torch.Generator().manual_seed(3)
    x = (torch.randn((48, 64), generator=g) * 0.05).to(torch.bfloat16)
    x[0:8] = 0.0  # an all-zero group
    x[8, 3] = -7.5  # negative maximum
    x[9, 5] = 7.5  # tie in magnitude with a negative value
    x[16:24] = torch.tensor(1e-40, dtype=torch.bfloat16)  # subnormal group
    x[17, 7] = -2e-40
    x = x.to(DEV)

    def amax(y):
        bits = torch.zeros(6, dtype=torch.int32, device=DEV)
        bad = torch.zeros(1, dtype=torch.int32, device=DEV)
        ks.seg_amax(y, 8, bits, bad)
        return bits.cpu(), int(bad.item())

    b16, n16 = amax(x)
    b32, n32 = amax(x.float())
    want = x.float().abs().reshape(6, -1).amax(dim=1).cpu().view(torch.int32)
    assert torch.equal(b16, b32) and torch.equal(b16, want) and n16 == n32 == 0
    y = x.clone()
    y[30, 1], y[41, 2], y[41, 3] = float("inf"), float("-inf"), float("nan")
    assert amax(y)[1] == amax(y.float())[1] == 3


def test_program_refuses_incomplete_state_dict():
    """The GPU path refuses what the per-unit path refuses, before anything is sent."""
    from precision_dsl.backends.weight_update import WeightSender, WeightUpdateError
    from precision_dsl.arch import load_architecture

    plan = _plan("mxfp8-e2e")
    weights = _weights(load_architecture("tiny-moe"), True)
    tr = _transport()
    sender = WeightSender(plan, tr)
    victim = plan.tensors[-1].hf_name
    with pytest.raises(WeightUpdateError, match="incomplete state dict"):
        sender.prepare_program([(n, x) for n, x in weights.items() if n != victim])
    with pytest.raises(WeightUpdateError, match="not in the plan|neither an HF nor a Megatron name"):
        sender.prepare_program(list(weights.items()) + [("model.layers.99.bogus.weight", weights[victim])])
    with pytest.raises(WeightUpdateError, match="sent twice"):
        sender.prepare_program(list(weights.items()) + [(victim, weights[victim])])
    assert tr.inner._q.empty() if _INTERP else tr._q.empty()  # nothing was sent
