"""Tests of the format-generic entry points (precision_dsl/formats/__init__.py): dispatch on TensorFormat,
fake_quantize, nbytes_of and the input contract (errors, views, empties, >2-D)."""

from __future__ import annotations

import pytest
import torch

from precision_dsl import formats
from precision_dsl.formats import FormatInputError, QuantizedTensor, fp8_block, fp8_tensor, mxfp8, nvfp4
from precision_dsl.precision import BF16, FormatKind, TensorFormat, hp

QUANTIZED_FORMATS = {
    "fp8_e4m3": TensorFormat(kind="fp8", element="e4m3"),
    "fp8_e5m2": TensorFormat(kind="fp8", element="e5m2", scale_dtype="fp32"),
    "fp8_block_1x128": TensorFormat(kind="fp8_block", element="e4m3", block=(1, 128), scale_dtype="pow2"),
    "fp8_block_128x128_fp32": TensorFormat(kind="fp8_block", element="e4m3", block=(128, 128), scale_dtype="fp32"),
    "mxfp8_1x32": TensorFormat(kind="mxfp8", element="e4m3", block=(1, 32), scale_dtype="e8m0"),
    "mxfp8_e5m2_32x1": TensorFormat(kind="mxfp8", element="e5m2", block=(32, 1), scale_dtype="e8m0"),
    "mxfp8_32x32": TensorFormat(kind="mxfp8", element="e4m3", block=(32, 32), scale_dtype="e8m0"),
    "nvfp4_tensor": TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3",
                                 global_scale="tensor"),
    "nvfp4_row": TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row"),
    "nvfp4_16x16": TensorFormat(kind="nvfp4", element="e2m1", block=(16, 16), scale_dtype="e4m3",
                                global_scale="tensor"),
    "nvfp4_expert": TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3",
                                 global_scale="expert"),
}


def _module_call(x, fmt, axis):
    """What the dispatch must be equivalent to (the per-format module APIs)."""
    if fmt.kind == FormatKind.FP8:
        return fp8_tensor.quantize(x, fmt.element, axis)
    if fmt.kind == FormatKind.FP8_BLOCK:
        return fp8_block.quantize(x, fmt.element, fmt.block, fmt.scale_dtype != "fp32", axis)
    if fmt.kind == FormatKind.MXFP8:
        if fmt.block == (32, 1):
            return mxfp8.quantize(x, fmt.element, "col")
        return mxfp8.quantize(x, fmt.element, axis, fmt.block == (32, 32))
    return nvfp4.quantize(x, axis, fmt.global_scale, fmt.block == (16, 16))


@pytest.mark.parametrize("name", sorted(QUANTIZED_FORMATS))
@pytest.mark.parametrize("axis", ["row", "col"])
def test_dispatch_fake_quantize_and_nbytes(name, axis):
    fmt = QUANTIZED_FORMATS[name]
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16) * 3
    q = formats.quantize(x, fmt, axis=axis)
    assert isinstance(q, QuantizedTensor) and q.fmt == fmt and q.shape == x.shape and q.orig_dtype == x.dtype
    ref = _module_call(x, fmt, axis)
    for key, t in ref.tensors().items():
        assert torch.equal(q.tensors()[key].view(torch.uint8), t.view(torch.uint8)), key
    deq = formats.dequantize(q)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    fq = formats.fake_quantize(x, fmt, axis=axis, out_dtype=torch.float32)
    assert torch.equal(fq.view(torch.int32), deq.view(torch.int32))
    assert formats.fake_quantize(x, fmt, axis=axis).dtype == torch.bfloat16
    assert formats.nbytes_of(fmt, x.shape, axis=axis) == q.nbytes


def test_high_precision_formats():
    x = torch.randn(3, 5)
    for kind in ("bf16", "fp16", "fp32"):
        assert formats.fake_quantize(x, hp(kind)) is x
        assert formats.nbytes_of(hp(kind), (3, 5)) == 15 * {"bf16": 2, "fp16": 2, "fp32": 4}[kind]
    assert formats.fake_quantize(x, BF16, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(FormatInputError, match="high-precision format"):
        formats.quantize(x, BF16)


def test_global_amax_and_groups():
    gate, up = torch.randn(32, 64), torch.randn(32, 64) * 4
    g = formats.group_amax([gate, up])
    fmt = TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="group")
    qg, qu = formats.quantize(gate, fmt, global_amax=g), formats.quantize(up, fmt, global_amax=g)
    assert torch.equal(qg.global_scale, qu.global_scale) and torch.equal(qg.global_amax, g)
    with pytest.raises(FormatInputError, match="needs global_amax"):
        formats.quantize(gate, fmt)
    with pytest.raises(FormatInputError, match="global_amax only applies to NVFP4"):
        formats.quantize(gate, QUANTIZED_FORMATS["mxfp8_1x32"], global_amax=g)


@pytest.mark.parametrize("fmt, match", [
    (TensorFormat(kind="mxfp8", element="e4m3", block=(1, 16)), "MXFP8 blocks are"),
    (TensorFormat(kind="nvfp4", element="e2m1", block=(1, 32)), "NVFP4 blocks are"),
    (TensorFormat(kind="fp8_block", element="e4m3", block=(1, 64)), "needs block"),
    (TensorFormat(kind="fp8_block", element="e4m3", block=(1, 128), scale_dtype="e8m0"), "scale_dtype must be"),
])
def test_unsupported_format_parameters(fmt, match):
    with pytest.raises(FormatInputError, match=match):
        formats.quantize(torch.randn(128, 128), fmt)


def test_input_contract():
    fmt = QUANTIZED_FORMATS["nvfp4_row"]
    base = torch.randn(96, 64)
    view = base[::2]  # non-contiguous: accepted, same bytes as its contiguous copy
    assert torch.equal(formats.quantize(view, fmt).data, formats.quantize(view.contiguous(), fmt).data)
    x3 = torch.randn(2, 3, 16, 64)  # >2-D: flattened to [96, 64]
    assert torch.equal(formats.quantize(x3, fmt).data, formats.quantize(x3.reshape(96, 64), fmt).data)
    for f in QUANTIZED_FORMATS.values():  # empty tensors give empty results and round-trip
        q = formats.quantize(torch.zeros(0, 256), f)
        assert q.data.numel() == 0 and formats.dequantize(q).shape == (0, 256)
    with pytest.raises(FormatInputError, match="K \\(last dim\\)=40 is not divisible by the block size 32"):
        formats.quantize(torch.randn(4, 40), QUANTIZED_FORMATS["mxfp8_1x32"])
    with pytest.raises(FormatInputError, match="float32, bfloat16 or float16"):
        formats.fake_quantize(torch.ones(4, 32, dtype=torch.int64), QUANTIZED_FORMATS["mxfp8_1x32"])
    with pytest.raises(FormatInputError, match="expected a precision.TensorFormat"):
        formats.quantize(torch.randn(4, 32), "mxfp8")
    with pytest.raises(FormatInputError, match="at least one dim"):
        formats.nbytes_of(QUANTIZED_FORMATS["fp8_e4m3"], ())


def test_format_input_error_is_value_error():
    assert issubclass(FormatInputError, ValueError)
