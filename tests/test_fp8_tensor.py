"""Tests of the FP8 per-tensor current-scaling reference (precision_dsl/formats/fp8_tensor.py). No golden vectors
exist for this format; it shares its scale rule and cast with the golden-tested FP8-block reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_dsl.formats import FormatInputError, fp8_block, fp8_tensor

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def matrices(draw):
    m, k = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(m, k, generator=g) * 2.0 ** draw(st.integers(-40, 40))
    return x.to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))) if abs(x).max() < 6e4 \
        else x


@SETTINGS
@given(x=matrices(), element=st.sampled_from(["e4m3", "e5m2"]), axis=st.sampled_from(["row", "col"]))
def test_error_bound_and_layout(x, element, axis):
    q = fp8_tensor.quantize(x, element, axis)
    assert q.scale.shape == (1,) and q.scale.dtype == torch.float32
    assert q.data.shape == (x.shape if axis == "row" else x.t().shape)
    deq = fp8_tensor.dequantize(q).double()
    rel, sub = (2.0 ** -4, 2.0 ** -10) if element == "e4m3" else (2.0 ** -3, 2.0 ** -17)
    bound = torch.maximum(rel * x.double().abs(), sub * q.scale.double()) * (1 + 2 ** -20)
    assert bool(((deq - x.double()).abs() <= bound).all())


@SETTINGS
@given(x=matrices(), element=st.sampled_from(["e4m3", "e5m2"]))
def test_requantizing_dequantized_keeps_bytes(x, element):
    q = fp8_tensor.quantize(x, element)
    again = fp8_tensor.quantize(fp8_tensor.dequantize(q), element)
    assert torch.equal(q.data, again.data)


def test_same_bytes_as_one_128x128_block():
    x = torch.randn(128, 128) * 3
    a = fp8_tensor.quantize(x)
    b = fp8_block.quantize(x, "e4m3", (128, 128), pow2=False)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.int32), b.scale.view(-1).view(torch.int32))


def test_edge_cases():
    z = fp8_tensor.quantize(torch.zeros(3, 4))
    assert z.scale.item() == 1.0 and z.data.eq(0).all()
    big = fp8_tensor.quantize(torch.tensor([[448.0, -1e4, 0.5]]), "e4m3")
    assert big.data[0, 1].item() == 0xFE  # saturates to -448 after scaling
    tiny = fp8_tensor.quantize(torch.full((2, 2), 1e-39, dtype=torch.bfloat16))
    flt_max = torch.tensor([torch.finfo(torch.float32).max])
    assert torch.equal(tiny.scale, torch.reciprocal(flt_max))  # TE current scaling: an inf scale becomes FLT_MAX
    e = fp8_tensor.quantize(torch.zeros(0, 8))
    assert e.data.shape == (0, 8) and e.scale.item() == 1.0
    with pytest.raises(FormatInputError, match="element must be"):
        fp8_tensor.quantize(torch.randn(2, 2), "e3m4")
    with pytest.raises(FormatInputError, match="0-dim"):
        fp8_tensor.quantize(torch.tensor(2.0))
