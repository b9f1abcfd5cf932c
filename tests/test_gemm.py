"""Tests of the emulated low-precision GEMM (precision_dsl/formats/gemm.py)."""

from __future__ import annotations

import pytest
import torch

from precision_dsl.formats import FormatInputError, dequantize, fake_quantize, gemm, mxfp8, nvfp4, quantize
from precision_dsl.precision import BF16, TensorFormat, hp

MXFP8 = mxfp8.make_format("e4m3")
NVFP4_ROW = nvfp4.make_format("row")
NVFP4_TENSOR = nvfp4.make_format("tensor")
FP8_BLOCK = TensorFormat(kind="fp8_block", element="e4m3", block=(1, 128), scale_dtype="pow2")


def _data(seed=0, m=12, k=128, n=48):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, m, k, generator=g, dtype=torch.float32).to(torch.bfloat16), torch.randn(n, k, generator=g)


def test_high_precision_is_plain_linear():
    x, w = _data()
    bias = torch.randn(48)
    y = gemm.emulated_linear(x, w, hp("fp32"), bias=bias, out_dtype=torch.float32)
    ref = torch.nn.functional.linear(x.float(), w, bias)
    assert torch.equal(y, ref)


@pytest.mark.parametrize("w_fmt, a_fmt", [(MXFP8, MXFP8), (NVFP4_TENSOR, NVFP4_ROW), (FP8_BLOCK, FP8_BLOCK),
                                          (NVFP4_TENSOR, BF16)])
def test_equals_dequantized_operands_matmul(w_fmt, a_fmt):
    x, w = _data()
    wq = quantize(w, w_fmt)
    y = gemm.emulated_linear(x, wq, a_fmt, out_dtype=torch.float32)
    xq = fake_quantize(x, a_fmt, out_dtype=torch.float32)
    ref = torch.matmul(xq, dequantize(wq).t())
    assert y.shape == (2, 12, 48) and y.dtype == torch.float32
    assert torch.equal(y, ref)
    # and it approximates the exact product
    exact = x.float() @ w.t()
    rel = ((y - exact).norm() / exact.norm()).item()
    assert rel < (0.2 if w_fmt.kind.value == "nvfp4" else 0.08), rel


def test_output_dtype_bias_and_bf16_compute():
    x, w = _data()
    wq = quantize(w, MXFP8)
    y = gemm.emulated_linear(x, wq, MXFP8, bias=torch.ones(48))
    assert y.dtype == torch.bfloat16
    y16 = gemm.emulated_linear(x, wq, MXFP8, bias=torch.ones(48), compute_dtype=torch.bfloat16,
                               out_dtype=torch.float32)
    torch.testing.assert_close(y16, y.float(), rtol=0.05, atol=0.3)


def test_per_token_activations_are_row_independent():
    x, w = _data()
    wq = quantize(w, NVFP4_TENSOR)
    y = gemm.emulated_linear(x, wq, NVFP4_ROW, out_dtype=torch.float32)
    x2 = x.clone()
    x2[:, 1:] *= 1000  # every other token changes
    y2 = gemm.emulated_linear(x2, wq, NVFP4_ROW, out_dtype=torch.float32)
    assert torch.equal(y[:, 0], y2[:, 0])


def test_bad_inputs():
    x, w = _data()
    with pytest.raises(FormatInputError, match="x last dim 64 != weight K 128"):
        gemm.emulated_linear(torch.randn(3, 64), quantize(w, MXFP8), MXFP8)
    with pytest.raises(FormatInputError, match="rowwise copy"):
        gemm.emulated_linear(x, quantize(torch.randn(64, 128), MXFP8, axis="col"), MXFP8)
    with pytest.raises(FormatInputError, match="QuantizedTensor or a tensor"):
        gemm.emulated_linear(x, "weight", MXFP8)
    with pytest.raises(FormatInputError, match="2-D"):
        gemm.emulated_linear(x, torch.randn(2, 48, 128), BF16)
