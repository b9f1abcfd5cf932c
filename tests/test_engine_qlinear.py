"""engine/qlinear.py: forward numerics, the three backward rules, share-scale groups, plan validation."""

from __future__ import annotations

import pytest
import torch

from precision_dsl import formats
from precision_dsl.engine.numerics import EngineFormatError
from precision_dsl.engine.qlinear import LinearSpec, linear_specs, qlinear, quantize_weights
from precision_dsl.precision import BackwardMode, FormatKind, TensorFormat

BF16 = TensorFormat(kind=FormatKind.BF16, element="bf16")
MX = TensorFormat(kind=FormatKind.MXFP8, element="e4m3", block=(1, 32), scale_dtype="e8m0")
NV_ROW = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row")
NV_T = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="tensor")


def bf(t):
    return t.to(torch.bfloat16).float()


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g)  # 40 tokens: not a multiple of 32 (exercises wgrad padding)
    w = torch.randn(96, 64, generator=g) * 0.1
    gy = torch.randn(40, 96, generator=g)
    return x, w, gy


def _run(spec, x, w, gy):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    w_fwd = formats.fake_quantize(bf(w.detach()), spec.weight, out_dtype=torch.float32) \
        if spec.weight.is_quantized else bf(w.detach())
    y = qlinear(x, w, w_fwd, spec)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, w_fwd


@pytest.mark.parametrize("wf,af", [(NV_T, NV_ROW), (MX, MX)])
def test_forward_is_quantized_activation_times_quantized_weight(operands, wf, af):
    x, w, gy = operands
    spec = LinearSpec("t", wf, af, BF16, BackwardMode.HIGH_PRECISION)
    y, _, _, w_fwd = _run(spec, x, w, gy)
    xq = formats.fake_quantize(bf(x), af, out_dtype=torch.float32)
    assert torch.equal(y, xq @ w_fwd.t())
    assert not torch.equal(y, bf(x) @ bf(w).t())  # quantization actually happened


@pytest.mark.parametrize("wf,af", [(NV_T, NV_ROW), (MX, MX)])
def test_high_precision_backward_uses_original_bf16_operands(operands, wf, af):
    x, w, gy = operands
    _, dx, dw, _ = _run(LinearSpec("t", wf, af, BF16, BackwardMode.HIGH_PRECISION), x, w, gy)
    # reference: plain autograd through a BF16-operand matmul, BF16 incoming gradient
    xr, wr = bf(x).requires_grad_(True), bf(w).requires_grad_(True)
    (xr @ wr.t()).backward(bf(gy))
    assert torch.allclose(dx, xr.grad, rtol=0, atol=1e-6) and torch.allclose(dw, wr.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wf,af", [(NV_T, NV_ROW), (MX, MX)])
def test_dequantized_backward_uses_bf16_dequantized_forward_operands(operands, wf, af):
    """TE 2.20.2 (NVTE_BACKWARD_OVERRIDE=dequantized) multiplies `dequantize(dtype=bf16)` of the saved quantized
    input and weight: the fp32 dequantized values rounded once to bf16."""
    x, w, gy = operands
    _, dx, dw, w_fwd = _run(LinearSpec("t", wf, af, BF16, BackwardMode.DEQUANTIZED), x, w, gy)
    xq32 = formats.fake_quantize(bf(x), af, out_dtype=torch.float32)
    xq = bf(xq32).requires_grad_(True)
    wq = bf(w_fwd).requires_grad_(True)
    (xq @ wq.t()).backward(bf(gy))
    assert torch.allclose(dx, xq.grad, rtol=0, atol=1e-6) and torch.allclose(dw, wq.grad, rtol=0, atol=1e-6)
    if af.kind == FormatKind.NVFP4:  # the fp32 second-level scales make the bf16 rounding real ...
        assert not torch.equal(bf(xq32), xq32)  # (the per-tensor S_dec of this weight may happen to be exact)
        x32, w32 = xq32.clone().requires_grad_(True), w_fwd.clone().requires_grad_(True)
        (x32 @ w32.t()).backward(bf(gy))  # the fp32-operand backward this engine ran before TE's rule was adopted
        assert not torch.equal(dw, w32.grad)
    else:  # ... while MXFP8's dequantized values are bf16 already (E4M3 x 2^k)
        assert torch.equal(bf(xq32), xq32) and torch.equal(bf(w_fwd), w_fwd)
    _, dx_hp, dw_hp, _ = _run(LinearSpec("t", wf, af, BF16, BackwardMode.HIGH_PRECISION), x, w, gy)
    assert not torch.equal(dw, dw_hp)  # the two modes really differ


def test_quantized_backward_mxfp8_columnwise_copies(operands):
    x, w, gy = operands
    _, dx, dw, _ = _run(LinearSpec("t", MX, MX, MX, BackwardMode.QUANTIZED), x, w, gy)
    g = bf(gy)
    # dgrad contracts over N: g blocks along N (rowwise), W blocks along its rows (columnwise copy)
    g_row = formats.fake_quantize(g, MX, out_dtype=torch.float32)
    w_col = formats.fake_quantize(bf(w), MX, axis="col", out_dtype=torch.float32)
    assert torch.allclose(dx, g_row @ w_col, rtol=0, atol=1e-5)
    # wgrad contracts over tokens: columnwise copies of g and x, token dim zero-padded to 64 (zeros: no effect)
    pad = lambda t: torch.cat([t, t.new_zeros(64 - t.shape[0], t.shape[1])])  # noqa: E731
    g_col = formats.fake_quantize(pad(g), MX, axis="col", out_dtype=torch.float32)[:40]
    x_col = formats.fake_quantize(pad(bf(x)), MX, axis="col", out_dtype=torch.float32)[:40]
    assert torch.allclose(dw, g_col.t() @ x_col, rtol=0, atol=1e-5)
    _, _, dw_hp, _ = _run(LinearSpec("t", MX, MX, BF16, BackwardMode.HIGH_PRECISION), x, w, gy)
    assert not torch.equal(dw, dw_hp)


def _plan(policy):
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.plans import load_plan

    return load_plan(policy, load_architecture("tiny-moe"))


def test_share_scale_group_gate_up_use_one_global_amax():
    from precision_dsl.engine.model import bundled_model_dir, load_model

    plan = _plan("nvfp4-pertoken-dequant-backward")
    model = load_model(bundled_model_dir("tiny-moe"))
    params = {n: p for n, p in model.named_parameters()}
    q = quantize_weights(plan, params)
    gate = "model.layers.0.mlp.experts.3.gate_proj.weight"
    up = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert plan.by_name()[gate].share_scale_group == plan.by_name()[up].share_scale_group is not None
    expected = formats.group_amax([bf(params[gate].detach()), bf(params[up].detach())])
    assert torch.equal(q[gate].global_amax, expected) and torch.equal(q[up].global_amax, expected)
    assert torch.equal(q[gate].global_scale, q[up].global_scale)
    # down_proj is not in a group: its own amax
    down = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert torch.equal(q[down].global_amax, bf(params[down].detach()).abs().amax().reshape(1))
    # BF16 tensors travel as BF16
    assert q["model.norm.weight"].dtype == torch.bfloat16


def test_nvfp4_quantized_backward_is_refused():
    plan = _plan("nvfp4-pertoken-dequant-backward")
    t = next(t for t in plan.tensors if t.precision.weight.kind == FormatKind.NVFP4)
    bad = t.model_copy(update={"precision": t.precision.model_copy(update={
        "grad": NV_T, "backward": BackwardMode.QUANTIZED})})
    broken = plan.model_copy(update={"tensors": tuple(bad if x.hf_name == t.hf_name else x for x in plan.tensors)})
    with pytest.raises(EngineFormatError, match="quantized backward is fp8 / fp8_block / mxfp8 only"):
        linear_specs(broken)


def test_fp8_tiled_weights_quantized_as_groups_equal_each_quantized_alone():
    """quantize_weights stacks FP8 128x128 weights of one shape (N % 128 == 0) and quantizes the stack once: each
    weight's bytes, scales, metadata and BF16 copy must be its own quantization's; singletons and N % 128 != 0
    shapes take the per-tensor path."""
    from precision_dsl.engine import numerics

    plan = _plan("fp8-blockwise-hopper")
    by = plan.by_name()
    l0 = [n for n in by if n.startswith("model.layers.0.") and by[n].is_linear]
    fp8 = [n for n in l0 if by[n].precision.weight.kind == FormatKind.FP8_BLOCK]
    assert len(fp8) >= 10
    g = torch.Generator().manual_seed(0)
    shapes = {}
    for i, n in enumerate(fp8):
        if "experts" in n:
            shapes[n] = (384, 200) if "down" in n else (256, 384)  # down: K % 128 != 0 (partial tiles), stacked
        elif "k_proj" in n or "v_proj" in n:
            shapes[n] = (200, 256)  # N % 128 != 0: never stacked
        else:
            shapes[n] = (256, 256) if "q_proj" in n else (128, 512)  # o_proj alone in its shape: per tensor
    weights = {n: torch.randn(s, generator=g) * torch.exp(torch.randn(s[0], 1, generator=g) * 3)
               for n, s in shapes.items()}
    w16s: dict = {}
    got = quantize_weights(plan, weights, w16s)
    assert set(got) == set(weights) == set(w16s)
    for n, w in weights.items():
        w16 = w.to(torch.bfloat16)
        want = numerics.quantize(w16, by[n].precision.weight)
        q = got[n]
        assert (q.shape, q.axis, q.fmt, q.orig_dtype) == (want.shape, want.axis, want.fmt, want.orig_dtype), n
        assert torch.equal(q.data, want.data) and torch.equal(q.scale, want.scale), n
        assert torch.equal(w16s[n], w16), n
    from precision_dsl.engine.qlinear import _quantize_tiled_groups

    done = _quantize_tiled_groups(by, weights, {}, None)  # the stacked path really ran (the experts), and only there
    assert done == {n for n in fp8 if "experts" in n} and len(done) >= 6
