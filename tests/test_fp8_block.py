"""Property tests of the FP8 block-scaling reference (precision_dsl/formats/fp8_block.py). Golden: test_golden.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_dsl.formats import FormatInputError, fp8_block

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUB = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}


@st.composite
def matrices(draw, dtypes=(torch.float32, torch.bfloat16)):
    """Any [M, K] (partial 128-blocks included), per-row magnitudes over several octaves."""
    m = draw(st.integers(1, 300))
    k = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    log_lo = draw(st.integers(-30, 30))
    spread = draw(st.integers(0, 10))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0 ** (log_lo + spread * torch.rand(m, 1, generator=g))
    return x.to(draw(st.sampled_from(dtypes)))


def _recipes():
    return st.tuples(st.sampled_from(["e4m3", "e5m2"]), st.sampled_from([(1, 128), (128, 128)]), st.booleans(),
                     st.sampled_from(["row", "col"]))


def _per_element(scale_inv: torch.Tensor, block, rows: int, cols: int) -> torch.Tensor:
    s = scale_inv.double()
    if block[0] > 1:
        s = s.repeat_interleave(block[0], 0)
    return s.repeat_interleave(block[1], 1)[:rows, :cols]


@SETTINGS
@given(x=matrices(), recipe=_recipes())
def test_dequantize_error_bound(x, recipe):
    element, block, pow2, axis = recipe
    q = fp8_block.quantize(x, element, block, pow2, axis)
    m = x.float() if axis == "row" else x.float().t()
    assert q.data.shape == m.shape
    assert q.scale.shape == (-(-m.shape[0] // block[0]), -(-m.shape[1] // 128))
    deq = fp8_block.dequantize(q)
    deq_m = (deq if axis == "row" else deq.t()).double()
    unit = _per_element(q.scale, block, *m.shape)
    err = (deq_m - m.double()).abs()
    bound = torch.maximum(REL[element] * m.double().abs(), SUB[element] * unit) * (1 + 2 ** -20)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@SETTINGS
@given(x=matrices(), recipe=_recipes())
def test_requantizing_dequantized_is_idempotent(x, recipe):
    """pow2 scales: dequantized values are a fixed point. fp32 scales: the data bytes are (scale_inv may move an ulp)."""
    element, block, pow2, axis = recipe
    q = fp8_block.quantize(x, element, block, pow2, axis)
    deq = fp8_block.dequantize(q)
    again = fp8_block.quantize(deq, element, block, pow2, axis)
    if pow2:
        assert torch.equal(fp8_block.dequantize(again).view(torch.int32), deq.view(torch.int32))
    else:
        assert torch.equal(again.data, q.data)


@SETTINGS
@given(x=matrices(dtypes=(torch.float32,)), shift=st.integers(-20, 20))
def test_pow2_scaling_equivariance(x, shift):
    """Scale monotonicity: multiplying x by 2^k keeps the pow2 data bytes and divides every scale by 2^k."""
    x = torch.where(x.abs() < 2.0 ** -90, torch.zeros(()), x.clamp(-2.0 ** 90, 2.0 ** 90))
    q1 = fp8_block.quantize(x, "e4m3", (1, 128), True)
    q2 = fp8_block.quantize(x * 2.0 ** shift, "e4m3", (1, 128), True)
    assert torch.equal(q1.data, q2.data)
    block_amax = torch.nn.functional.pad(x, (0, -x.shape[1] % 128)).view(x.shape[0], -1, 128).abs().amax(-1)
    nonzero = block_amax > 0  # all-zero blocks keep scale 1 whatever the shift
    ratio = (q2.scale / q1.scale)[nonzero]
    assert bool((ratio == 2.0 ** shift).all())


def test_scale_monotone_in_amax():
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(20000, generator=g) * 10.0 ** torch.randint(-40, 38, (20000,), generator=g)
    amax = torch.sort(amax[amax > 0]).values  # amax == 0 is the special case scale = 1 (checked below)
    for pow2 in (True, False):
        s = fp8_block.scale_from_amax(amax, "e4m3", pow2, torch.finfo(torch.float32).max)
        assert bool((s[1:] <= s[:-1]).all())
    special = fp8_block.scale_from_amax(torch.tensor([0.0, float("inf"), float("nan"), 1e-39]), "e4m3", False,
                                        torch.finfo(torch.bfloat16).max)
    assert special[:3].tolist() == [1.0, 1.0, 1.0] and special[3].item() == torch.finfo(torch.bfloat16).max


def test_partial_blocks_use_valid_elements_only():
    x = torch.zeros(3, 130)
    x[:, 128:] = 7.0  # second (partial) block of each row has amax 7 -> scale 448/7 = 64 exactly
    x[:, 0] = 448.0
    q = fp8_block.quantize(x, "e4m3", (1, 128), pow2=False)
    assert q.scale.shape == (3, 2)
    assert q.scale[:, 0].eq(1.0).all() and q.scale[:, 1].eq(1 / 64).all()
    q2 = fp8_block.quantize(x, "e4m3", (128, 128), pow2=True)
    assert q2.scale.shape == (1, 2) and q2.scale[0, 1].item() == 1 / 64


def test_layouts_and_bad_inputs():
    x = torch.randn(2, 100, 200, dtype=torch.bfloat16)
    c = fp8_block.quantize(x, axis="col")
    assert c.data.shape == (200, 200) and c.scale.shape == (200, 2)
    assert fp8_block.dequantize(c, torch.bfloat16).shape == x.shape
    xt = torch.randn(64, 300).t()
    assert torch.equal(fp8_block.quantize(xt).data, fp8_block.quantize(xt.contiguous()).data)
    e = fp8_block.quantize(torch.zeros(0, 256))
    assert e.data.shape == (0, 256) and e.scale.shape == (0, 2)
    neg0 = fp8_block.quantize(torch.tensor([[-0.0, 0.0, 1.0]]))
    assert neg0.data[0].tolist()[:2] == [0x80, 0]
    with pytest.raises(FormatInputError, match="block must be"):
        fp8_block.quantize(torch.randn(4, 4), block=(1, 64))
    with pytest.raises(FormatInputError, match="element must be"):
        fp8_block.quantize(torch.randn(4, 4), element="e2m1")
    with pytest.raises(FormatInputError, match="not supported"):
        fp8_block.quantize(torch.randn(4, 4, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    x = torch.randn(300, 260, dtype=torch.bfloat16) * 10
    for block in fp8_block.BLOCKS:
        for pow2 in (True, False):
            a = fp8_block.quantize(x, "e4m3", block, pow2)
            b = fp8_block.quantize(x.cuda(), "e4m3", block, pow2)
            assert torch.equal(a.data, b.data.cpu())
            assert torch.equal(a.scale.view(torch.int32), b.scale.cpu().view(torch.int32))


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 128), (130, 129), (1, 5)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transpose_tiles_is_the_other_direction_quantized(shape, dtype):
    """128x128 tiles hold the same elements in either direction: transpose_tiles(row copy) == quantize(axis="col")
    and back, every field and byte (edge rows included: tiny, zero, -0.0, saturating, +-Inf)."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 4)
    if shape[0] > 4:
        x[1] *= 1e-30
        x[2] = 0
        x[3, ::3] = -0.0
        x[4, ::5] = float("inf")
    x = x.to(dtype)
    for element in ("e4m3", "e5m2"):
        for pow2 in (True, False):
            row = fp8_block.quantize(x, element, (128, 128), pow2, axis="row")
            col = fp8_block.quantize(x, element, (128, 128), pow2, axis="col")
            for got, want in ((fp8_block.transpose_tiles(row), col), (fp8_block.transpose_tiles(col), row)):
                assert (got.shape, got.axis, got.fmt, got.orig_dtype) == (want.shape, want.axis, want.fmt,
                                                                          want.orig_dtype)
                assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    with pytest.raises(FormatInputError, match="128x128"):
        fp8_block.transpose_tiles(fp8_block.quantize(x, "e4m3", (1, 128), True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_nan_element_becomes_byte_0x7f(dtype):
    """NaN: ignored by the block amax, and written as 0x7F whatever its sign or payload (cvt.rn.satfinite, so TE's
    kernels and ours). torch's fp32 -> bf16 cast makes NaN negative (0xFFFF): the reference had kept that sign and
    written 0xFF, which the H200 kernel test caught for bf16 inputs."""
    x = torch.ones(3, 256, dtype=dtype)
    x[0, 5] = float("nan")
    x[1, 7] = -float("nan")
    x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[2, 9] = -1  # all-ones bits: a negative NaN
    for element in ("e4m3", "e5m2"):
        for block in ((1, 128), (128, 128)):
            for axis in ("row", "col"):
                q = fp8_block.quantize(x, element, block, True, axis=axis)
                data = q.data if axis == "row" else q.data.t()
                assert [int(data[r, c]) for r, c in ((0, 5), (1, 7), (2, 9))] == [0x7F] * 3, (element, block, axis)
                ones = fp8_block.quantize(torch.ones(3, 256, dtype=dtype), element, block, True, axis=axis)
                keep = torch.ones_like(data, dtype=torch.bool)
                keep[0, 5] = keep[1, 7] = keep[2, 9] = False
                ref = ones.data if axis == "row" else ones.data.t()
                assert torch.equal(data[keep], ref[keep]) and torch.equal(q.scale, ones.scale)  # NaN ignored
