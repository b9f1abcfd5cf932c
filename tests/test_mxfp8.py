"""Property tests of the MXFP8 reference (precision_dsl/formats/mxfp8.py). Bit-exactness vs TE: tests/test_golden.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_dsl.formats import FormatInputError, mxfp8

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
# half an ulp relative (normal range) and half the smallest subnormal step (absolute, in scaled units)
REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUB = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}


@st.composite
def matrices(draw, row_mult=32, col_mult=32, max_blocks=4, dtypes=(torch.float32, torch.bfloat16)):
    """Random [M, K] tensors: per-row magnitudes spread over many octaves, some zero / -0.0 entries."""
    m = row_mult * draw(st.integers(1, max_blocks))
    k = col_mult * draw(st.integers(1, max_blocks))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    log_lo = draw(st.integers(-30, 20))
    spread = draw(st.integers(0, 12))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(seed)
    row_scale = 2.0 ** (log_lo + spread * torch.rand(m, 1, generator=g))
    x = torch.randn(m, k, generator=g) * row_scale
    zero_mask = torch.rand(m, k, generator=g) < 0.05
    x = torch.where(zero_mask, torch.zeros(()), x)
    if draw(st.booleans()):
        x[0, :min(k, 32)] = -0.0
    return x.to(dtype)


def _layouts():
    return st.sampled_from([("row", False), ("col", False), ("row", True)])


@SETTINGS
@given(x=matrices(), element=st.sampled_from(["e4m3", "e5m2"]), layout=_layouts())
def test_dequantize_error_bound(x, element, layout):
    axis, tile_2d = layout
    q = mxfp8.quantize(x, element, axis, tile_2d)
    deq = mxfp8.dequantize(q)
    xf = x.float()
    # per-element decode scale 2^(E-127)
    dec = mxfp8.e8m0_to_scale(q.scale).double()
    if tile_2d:
        dec = dec.repeat_interleave(32, 0).repeat_interleave(32, 1)
    elif axis == "row":
        dec = dec.repeat_interleave(32, 1)
    else:
        dec = dec.repeat_interleave(32, 0)
    err = (deq.double() - xf.double()).abs()
    bound = torch.maximum(REL[element] * xf.double().abs(), SUB[element] * dec)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert q.data.shape == x.shape and q.data.dtype == torch.uint8


@SETTINGS
@given(x=matrices(), element=st.sampled_from(["e4m3", "e5m2"]), layout=_layouts())
def test_scale_is_tight_power_of_two_ceiling(x, element, layout):
    """The block amax lands in (Fmax/2, Fmax] after scaling (E is the round-up exponent), for normal blocks."""
    axis, tile_2d = layout
    q = mxfp8.quantize(x, element, axis, tile_2d)
    xf = x.float()
    if tile_2d:
        amax = xf.abs().view(x.shape[0] // 32, 32, x.shape[1] // 32, 32).amax(dim=(1, 3))
    elif axis == "row":
        amax = xf.abs().view(x.shape[0], -1, 32).amax(-1)
    else:
        amax = xf.abs().view(-1, 32, x.shape[1]).amax(1)
    scaled = amax.double() / mxfp8.e8m0_to_scale(q.scale).double()
    normal = amax > 1e-30
    assert bool((scaled[normal] <= FMAX[element]).all())
    assert bool((scaled[normal] > FMAX[element] / 2).all())
    assert bool((q.scale[amax == 0] == 0).all())  # all-zero block -> E = 0


@SETTINGS
@given(x=matrices(), element=st.sampled_from(["e4m3", "e5m2"]), layout=_layouts())
def test_requantizing_dequantized_is_idempotent(x, element, layout):
    axis, tile_2d = layout
    once = mxfp8.fake_quantize(x.float(), element, axis, tile_2d)
    twice = mxfp8.fake_quantize(once, element, axis, tile_2d)
    assert torch.equal(once.view(torch.int32), twice.view(torch.int32))


@SETTINGS
@given(x=matrices(dtypes=(torch.float32,)), shift=st.integers(-20, 20), layout=_layouts())
def test_power_of_two_scaling_shifts_exponent_only(x, shift, layout):
    """Scale monotonicity / equivariance: x * 2^k keeps every data byte and adds k to every non-zero-block E."""
    axis, tile_2d = layout
    x = x.float().clamp(-1e6, 1e6)
    x = torch.where(x.abs() < 1e-12, torch.zeros(()), x)  # keep clear of fp32 subnormals after the shift
    q1 = mxfp8.quantize(x, "e4m3", axis, tile_2d)
    q2 = mxfp8.quantize(x * 2.0 ** shift, "e4m3", axis, tile_2d)
    nonzero = q1.scale != 0
    assert torch.equal(q1.data, q2.data)
    assert torch.equal(q2.scale[nonzero].int(), q1.scale[nonzero].int() + shift)


def test_scale_is_monotone_in_amax():
    g = torch.Generator().manual_seed(0)
    amax = torch.sort(torch.cat([torch.rand(20000, generator=g) * 10.0 ** torch.randint(-40, 38, (20000,), generator=g),
                                 torch.tensor([0.0, 2.0 ** -149, 448 * 2.0 ** -127, 3.4e38])])).values
    for element in ("e4m3", "e5m2"):
        e = mxfp8.scale_from_amax(amax, element).int()
        assert bool((e[1:] >= e[:-1]).all())
    assert mxfp8.scale_from_amax(torch.tensor([float("inf"), float("nan")]), "e4m3").tolist() == [254, 255]


@SETTINGS
@given(x=matrices(row_mult=1, max_blocks=6), row=st.integers(0, 5), seed=st.integers(0, 1000))
def test_rowwise_rows_are_independent(x, row, seed):
    """Per-token independence: a row's bytes do not depend on the other rows (1x32 rowwise)."""
    row = row % x.shape[0]
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype) * 1e3
    other[row] = x[row]
    qa, qb = mxfp8.quantize(x, "e4m3"), mxfp8.quantize(other, "e4m3")
    assert torch.equal(qa.data[row], qb.data[row]) and torch.equal(qa.scale[row], qb.scale[row])


def test_edge_values():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([448.0, -448.0, 1e9, float("inf"), -float("inf"), float("nan")])
    q = mxfp8.quantize(x, "e4m3")
    assert q.scale.item() == 254  # inf amax -> E = 254
    assert q.data[0, 3].item() == 0x7E and q.data[0, 4].item() == 0xFE and q.data[0, 5].item() == 0x7F
    neg_nan = torch.full((1, 32), 1.0)
    neg_nan[0, 0] = -float("nan")
    q = mxfp8.quantize(neg_nan, "e5m2")
    assert q.data[0, 0].item() == 0x7F  # TE: 0x7F for every NaN
    assert q.scale.item() == mxfp8.scale_from_amax(torch.tensor(1.0), "e5m2").item()  # NaN ignored by amax
    zeros = torch.zeros(32, 32)
    zeros[0, 0] = -0.0
    q = mxfp8.quantize(zeros, "e4m3")
    assert q.scale.eq(0).all() and q.data[0, 0].item() == 0x80 and q.data[0, 1].item() == 0
    tiny = torch.full((1, 32), 1e-38)  # E = 0 and TE's non-zero bytes RN(x * 2^127)
    q = mxfp8.quantize(tiny, "e4m3")
    assert q.scale.item() == 0 and q.data[0, 0].item() != 0


def test_layouts_and_shapes():
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    r = mxfp8.quantize(x, axis="row")
    c = mxfp8.quantize(x, axis="col")
    t = mxfp8.quantize(x, tile_2d=True)
    assert r.data.shape == (64, 64) and r.scale.shape == (64, 2)
    assert c.data.shape == (64, 64) and c.scale.shape == (2, 64)
    assert t.data.shape == (64, 64) and t.scale.shape == (2, 2)
    assert mxfp8.dequantize(r, torch.bfloat16).shape == x.shape
    # >2-D input == its [M, K] flattening; non-contiguous view == its contiguous copy
    assert torch.equal(r.data, mxfp8.quantize(x.reshape(64, 64)).data)
    xt = torch.randn(64, 96).t()
    assert torch.equal(mxfp8.quantize(xt).data, mxfp8.quantize(xt.contiguous()).data)
    empty = mxfp8.quantize(torch.zeros(0, 64))
    assert empty.data.shape == (0, 64) and empty.scale.shape == (0, 2)
    assert mxfp8.dequantize(empty).shape == (0, 64)


def test_fake_quantize_matches_two_step():
    x = torch.randn(64, 128, dtype=torch.bfloat16) * 3
    for axis, tile_2d in (("row", False), ("col", False), ("row", True)):
        a = mxfp8.fake_quantize(x, "e4m3", axis, tile_2d, out_dtype=torch.float32)
        b = mxfp8.dequantize(mxfp8.quantize(x, "e4m3", axis, tile_2d))
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert mxfp8.fake_quantize(x).dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [
    (lambda: mxfp8.quantize(torch.randn(4, 48)), r"K \(last dim\)=48 is not divisible by the block size 32"),
    (lambda: mxfp8.quantize(torch.randn(48, 32), axis="col"), r"M \(product of leading dims\)=48"),
    (lambda: mxfp8.quantize(torch.randn(32, 32, dtype=torch.float64)), "dtype torch.float64 is not supported"),
    (lambda: mxfp8.quantize(torch.ones(32, 32, dtype=torch.int32)), "not supported"),
    (lambda: mxfp8.quantize(torch.tensor(1.0)), "0-dim scalar"),
    (lambda: mxfp8.quantize(torch.randn(32, 32), element="e2m1"), "element must be"),
    (lambda: mxfp8.quantize(torch.randn(32, 32), axis="diag"), "axis must be"),
    (lambda: mxfp8.quantize([1.0] * 32), "expected a torch.Tensor"),
    (lambda: mxfp8.fake_quantize(torch.randn(32, 32), axis="cols"), "axis must be"),
])
def test_bad_input_errors(bad, match):
    with pytest.raises(FormatInputError, match=match):
        bad()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    x = torch.randn(256, 512, dtype=torch.bfloat16) * 10
    for axis, tile_2d in (("row", False), ("col", False), ("row", True)):
        for element in ("e4m3", "e5m2"):
            a = mxfp8.quantize(x, element, axis, tile_2d)
            b = mxfp8.quantize(x.cuda(), element, axis, tile_2d)
            assert torch.equal(a.data, b.data.cpu()) and torch.equal(a.scale, b.scale.cpu())
