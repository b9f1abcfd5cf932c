"""Property tests of the NVFP4 reference (precision_dsl/formats/nvfp4.py). Bit-exactness vs TE: tests/test_golden.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_dsl.formats import FormatInputError, nvfp4

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLT_MAX = torch.finfo(torch.float32).max


@st.composite
def matrices(draw, max_blocks=4, spread_max=6, dtypes=(torch.float32, torch.bfloat16)):
    """[M, K] with M, K multiples of 16; per-row magnitudes spread over `spread` octaves."""
    m = 16 * draw(st.integers(1, max_blocks))
    k = 16 * draw(st.integers(1, max_blocks))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    log_lo = draw(st.integers(-20, 20))
    spread = draw(st.integers(0, spread_max))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0 ** (log_lo + spread * torch.rand(m, 1, generator=g))
    return x.to(dtype)


def _variants():
    return st.sampled_from([("row", "tensor", False), ("row", "row", False), ("col", "tensor", False),
                            ("col", "row", False), ("row", "tensor", True), ("col", "tensor", True)])


def _per_element(q: nvfp4.QuantizedTensor, rows: int, cols: int) -> torch.Tensor:
    """fp64 decode unit sf * S_dec per element of the quantized matrix (x or x.T)."""
    sf = q.scale.view(torch.float8_e4m3fn).double()
    if q.fmt.block == (16, 16):
        sf = sf.repeat_interleave(16, 0)
    sf = sf.repeat_interleave(16, 1)
    s_dec = q.global_scale.double().view(-1, 1)
    return sf[:rows, :cols] * s_dec


@SETTINGS
@given(x=matrices(), variant=_variants())
def test_dequantize_error_bound(x, variant):
    """|deq - x| <= max(1/4 unit, |x|/4) where unit = sf * S_dec (E2M1 half-steps are 0.25 below 2 and at most a
    quarter of the value above), plus fp32 rounding slack; blocks with a zero scale dequantize to 0."""
    axis, scope, tile_2d = variant
    q = nvfp4.quantize(x, axis, scope, tile_2d)
    m = x.float() if axis == "row" else x.float().t()
    deq = nvfp4.dequantize(q)
    deq_m = deq if axis == "row" else deq.t()
    unit = _per_element(q, *m.shape)
    err = (deq_m.double() - m.double()).abs()
    bound = torch.maximum(0.25 * unit, 0.25 * m.double().abs()) * (1 + 2 ** -18)
    zero_scale = unit == 0
    bound = torch.where(zero_scale, m.double().abs(), bound)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    # the block max maps to ~6: the scale covers the block amax within one E4M3 rounding
    assert q.data.dtype == torch.uint8 and q.data.shape == (m.shape[0], m.shape[1] // 2)


@SETTINGS
@given(x=matrices(spread_max=3), variant=_variants())
def test_requantizing_dequantized_is_idempotent(x, variant):
    """quantize(dequantize(q)) gives the same codes and block scales, both with the original G passed in and with
    G recomputed from the dequantized tensor (S_dec may move by an fp32 ulp; the bytes must not). The one allowed
    change: code 8 (a negative value that rounded to zero, decoded as -0.0) requantizes to code 0, because an
    exact -0.0 input encodes as +0 (TE's reference semantics)."""
    axis, scope, tile_2d = variant
    q = nvfp4.quantize(x, axis, scope, tile_2d)
    sf = q.scale.view(torch.float8_e4m3fn).float()
    if bool((sf < 2.0 ** -6).any()):  # E4M3-subnormal block scales lose bits on the round trip
        return
    deq = nvfp4.dequantize(q)
    expected = _neg_zero_to_zero(q.data)
    again = nvfp4.quantize(deq, axis, scope, tile_2d)
    assert torch.equal(expected, again.data) and torch.equal(q.scale, again.scale)
    # values: equal up to the fp32 ulp S_dec may have moved by (recomputed G), exactly equal where S_dec did not
    torch.testing.assert_close(nvfp4.dequantize(again), deq, rtol=2 ** -21, atol=0)
    if torch.equal(again.global_scale, q.global_scale):
        assert bool((nvfp4.dequantize(again) == deq).all())  # numerically (-0.0 == 0.0)
    if scope == "tensor":
        given_g = nvfp4.quantize(deq, axis, scope, tile_2d, global_amax=q.global_amax)
        assert torch.equal(expected, given_g.data) and torch.equal(q.scale, given_g.scale)
        assert torch.equal(q.global_scale, given_g.global_scale)


def _neg_zero_to_zero(data: torch.Tensor) -> torch.Tensor:
    lo, hi = data & 0xF, data >> 4
    lo = torch.where(lo == 8, torch.zeros_like(lo), lo)
    hi = torch.where(hi == 8, torch.zeros_like(hi), hi)
    return lo | (hi << 4)


@SETTINGS
@given(x=matrices(max_blocks=3), row=st.integers(0, 47), seed=st.integers(0, 1000))
def test_per_row_scope_rows_are_independent(x, row, seed):
    """Per-token NVFP4: a row's data, scales and S_dec do not change when the other rows change."""
    row = row % x.shape[0]
    other = (torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * 1e4).to(x.dtype)
    other[row] = x[row]
    qa = nvfp4.quantize(x, scope="row")
    qb = nvfp4.quantize(other, scope="row")
    assert torch.equal(qa.data[row], qb.data[row]) and torch.equal(qa.scale[row], qb.scale[row])
    assert torch.equal(qa.global_scale[row].view(torch.int32), qb.global_scale[row].view(torch.int32))


@SETTINGS
@given(gate=matrices(max_blocks=2, dtypes=(torch.bfloat16,)), ratio=st.integers(-8, 8))
def test_share_scale_group_gate_up(gate, ratio):
    """gate+up with group_amax: one S_dec for both, and the bytes equal quantizing the fused [gate; up] tensor
    (Miles' fused gate_up_proj) and equal quantizing each member with that amax."""
    up = (gate.float().flip(0) * 2.0 ** ratio).to(gate.dtype)
    g = nvfp4.group_amax([gate, up])
    assert g.shape == (1,) and g.item() == max(gate.float().abs().max().item(), up.float().abs().max().item())
    qg = nvfp4.quantize(gate, scope="group", global_amax=g)
    qu = nvfp4.quantize(up, scope="group", global_amax=g)
    assert torch.equal(qg.global_scale, qu.global_scale)
    fused = nvfp4.quantize(torch.cat([gate, up]), scope="tensor")
    assert torch.equal(fused.global_scale, qg.global_scale)
    assert torch.equal(torch.cat([qg.data, qu.data]), fused.data)
    assert torch.equal(torch.cat([qg.scale, qu.scale]), fused.scale)
    # expert scope with a given amax is the same computation
    qe = nvfp4.quantize(gate, scope="expert", global_amax=g.item())
    assert torch.equal(qe.data, qg.data)


def test_block_scale_is_monotone_in_block_amax():
    g = torch.tensor([3.7])
    s_enc = nvfp4.global_encode_scale(g)
    s_dec = nvfp4.global_decode_scale(s_enc)
    a_b = torch.sort(torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 3.7).values.view(-1, 1)
    sf, enc = nvfp4._block_scale_and_enc(a_b, s_enc, s_dec)
    sff = sf.float().flatten()
    assert bool((sff[1:] >= sff[:-1]).all())
    assert bool((enc.flatten()[1:] <= enc.flatten()[:-1]).all())
    # S_enc is monotone decreasing in G, with TE's 0 / inf guards
    gs = torch.tensor([0.0, 1e-38, 1e-3, 1.0, 2688.0, 3e38, float("inf")])
    se = nvfp4.global_encode_scale(gs)
    assert se[0].item() == 1.0 and se[-1].item() == 1.0 and se[1].item() == FLT_MAX
    assert bool((se[2:-1][1:] <= se[2:-1][:-1]).all())


def test_e2m1_rounding_ties_and_signs():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.0, 0.0, float("nan"), -6.5])
    r, neg = nvfp4.e2m1_round(y)
    assert r.tolist()[:8] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    codes = nvfp4.e2m1_codes(r, neg).tolist()
    assert codes[8] == 8 and codes[9] == 0 and codes[10] == 0  # negative-to-zero keeps sign, -0.0 does not
    assert codes[11] == 7 and codes[12] == 15


def test_edge_cases():
    z = nvfp4.quantize(torch.zeros(16, 32))
    assert z.data.eq(0).all() and z.scale.eq(0).all() and z.global_scale.item() == 1.0
    # block-scale underflow: tiny block next to a huge one -> scale 0, codes +-6 (TE behaviour)
    x = torch.zeros(1, 32)
    x[0, 0] = 1e6
    x[0, 16:] = 1e-3
    x[0, 17] = -1e-3
    q = nvfp4.quantize(x)
    assert q.scale[0, 1].item() == 0
    assert (q.data[0, 8].item() & 0xF) == 7 and (q.data[0, 8].item() >> 4) == 15
    assert nvfp4.dequantize(q)[0, 16:].eq(0).all()
    # packing order: element 2j in the low nibble
    p = torch.zeros(1, 16)
    p[0, 0], p[0, 1] = 6.0, -3.0
    assert nvfp4.quantize(p).data[0, 0].item() == (0xD << 4) | 0x7


def test_layouts_and_shapes():
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    r = nvfp4.quantize(x, scope="row")
    assert r.data.shape == (32, 32) and r.scale.shape == (32, 4) and r.global_scale.shape == (32,)
    c = nvfp4.quantize(x, axis="col")
    assert c.data.shape == (64, 16) and c.scale.shape == (64, 2) and c.global_scale.shape == (1,)
    t = nvfp4.quantize(x, tile_2d=True)
    assert t.scale.shape == (2, 4)
    assert nvfp4.dequantize(c, torch.bfloat16).shape == x.shape
    xt = torch.randn(64, 48).t()
    assert torch.equal(nvfp4.quantize(xt).data, nvfp4.quantize(xt.contiguous()).data)
    e = nvfp4.quantize(torch.zeros(0, 32))
    assert e.data.shape == (0, 16) and e.global_amax.item() == 0.0
    er = nvfp4.quantize(torch.zeros(0, 32), scope="row")
    assert er.global_scale.shape == (0,)


def test_fake_quantize_matches_two_step():
    x = torch.randn(32, 64) * 7
    x[0, :4] = -0.0
    x[1, 3] = -1e-30
    for axis, scope, tile_2d in (("row", "tensor", False), ("col", "row", False), ("row", "tensor", True)):
        a = nvfp4.fake_quantize(x, axis, scope, tile_2d)
        b = nvfp4.dequantize(nvfp4.quantize(x, axis, scope, tile_2d))
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("bad, match", [
    (lambda: nvfp4.quantize(torch.randn(16, 40)), r"K \(last dim\)=40 is not divisible by the block size 16"),
    (lambda: nvfp4.quantize(torch.randn(24, 32), axis="col"), r"M \(product of leading dims\)=24"),
    (lambda: nvfp4.quantize(torch.randn(24, 32), tile_2d=True), r"M \(product of leading dims\)=24"),
    (lambda: nvfp4.quantize(torch.randn(16, 32), scope="row", tile_2d=True), "16x16 tiles need a per-tensor"),
    (lambda: nvfp4.quantize(torch.randn(16, 32), scope="group"), "needs global_amax"),
    (lambda: nvfp4.quantize(torch.randn(16, 32), scope="token"), "scope must be one of"),
    (lambda: nvfp4.quantize(torch.randn(16, 32), global_amax=torch.ones(3)), "global_amax must have 1 element"),
    (lambda: nvfp4.quantize(torch.randn(16, 32).half().to(torch.float8_e4m3fn)), "not supported"),
    (lambda: nvfp4.group_amax([]), "at least one tensor"),
    (lambda: nvfp4.quantize(torch.randn(16, 32), global_amax=-1.0), "global_amax must be >= 0"),
    (lambda: nvfp4.fake_quantize(torch.randn(16, 32), axis="rows"), "axis must be"),
])
def test_bad_input_errors(bad, match):
    with pytest.raises(FormatInputError, match=match):
        bad()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    x = torch.randn(256, 512, dtype=torch.bfloat16) * 10
    for axis, scope, tile_2d in (("row", "tensor", False), ("row", "row", False), ("col", "tensor", True)):
        a = nvfp4.quantize(x, axis, scope, tile_2d)
        b = nvfp4.quantize(x.cuda(), axis, scope, tile_2d)
        for name in ("data", "scale"):
            assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
        assert torch.equal(a.global_scale.view(torch.int32), b.global_scale.cpu().view(torch.int32))
