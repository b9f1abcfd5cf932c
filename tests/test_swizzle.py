"""Tests of the 128x4 GEMM scale swizzle (precision_dsl/formats/swizzle.py); golden swizzled bytes: test_golden.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_dsl.formats import FormatInputError, fp8_block, mxfp8, nvfp4, swizzle


def _by_formula(s: torch.Tensor) -> torch.Tensor:
    """The README's offset formula, one byte at a time (small matrices only)."""
    r, c = s.shape
    rp, cp = swizzle.swizzled_shape(r, c)
    out = torch.zeros(rp * cp, dtype=torch.uint8)
    for i in range(r):
        for j in range(c):
            off = ((i // 128) * (cp // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)
            out[off] = s[i, j]
    return out.view(rp, cp)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 300), cols=st.integers(0, 20), seed=st.integers(0, 1000))
def test_round_trip_and_zero_padding(rows, cols, seed):
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    sw = swizzle.swizzle_128x4(s)
    assert sw.shape == swizzle.swizzled_shape(rows, cols)
    assert torch.equal(swizzle.unswizzle_128x4(sw, rows, cols), s)
    assert torch.equal(swizzle.unswizzle_128x4(sw.reshape(-1), rows, cols), s)
    assert int(sw.ne(0).sum()) == int(s.ne(0).sum())  # padding is zero, nothing lost


@pytest.mark.parametrize("rows, cols", [(1, 1), (130, 5), (256, 8), (33, 3)])
def test_matches_offset_formula(rows, cols):
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    assert torch.equal(swizzle.swizzle_128x4(s), _by_formula(s))


def test_logical_scale_per_format():
    x = torch.randn(64, 128)
    row, col = mxfp8.quantize(x, axis="row"), mxfp8.quantize(x, axis="col")
    assert torch.equal(swizzle.logical_scale_for_gemm(row), row.scale)
    assert torch.equal(swizzle.logical_scale_for_gemm(col), col.scale.t())
    q = nvfp4.quantize(x, axis="col")
    assert torch.equal(swizzle.swizzled_scale(q), swizzle.swizzle_128x4(q.scale))
    with pytest.raises(FormatInputError, match="no GEMM-swizzled scale layout"):
        swizzle.swizzled_scale(fp8_block.quantize(x))
    with pytest.raises(FormatInputError, match="expected 512 bytes"):
        swizzle.unswizzle_128x4(torch.zeros(10, dtype=torch.uint8), 2, 2)
    with pytest.raises(FormatInputError, match="must be 2-D"):
        swizzle.swizzle_128x4(torch.zeros(4, dtype=torch.uint8))
