"""Format calls -> Precision (lang/formats.py): every format, defaults, operands, backward modes, and every error."""

from __future__ import annotations

import pytest

from precision_dsl.lang.formats import FORMAT_ARGS, precision_from_spec
from precision_dsl.lang.parser import parse_policy
from precision_dsl.precision import BackwardMode, FormatError, FormatKind, TensorFormat


def spec(rhs: str):
    p = parse_policy('policy "f" {\n    attn: ' + rhs + "\n}", "f.policy")
    return p.statements[0].precision


def prec(rhs: str):
    return precision_from_spec(spec(rhs))


def ferr(rhs: str) -> FormatError:
    with pytest.raises(FormatError) as ei:
        prec(rhs)
    return ei.value


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_high_precision(name):
    p = prec(name)
    assert p.weight == p.activation == p.grad == TensorFormat(kind=FormatKind(name), element=name)
    assert p.backward == BackwardMode.HIGH_PRECISION and not p.is_quantized


def test_fp8_per_tensor_e4m3_and_hybrid():
    p = prec("fp8")
    assert p.weight.kind == FormatKind.FP8 and p.weight.element == "e4m3" and p.weight.block is None
    assert p.weight.global_scale == "tensor" and p.grad.element == "e4m3"
    assert p.backward == BackwardMode.QUANTIZED  # default backward of fp8
    h = prec("fp8(hybrid)")
    assert h.activation.element == "e4m3" and h.grad.element == "e5m2"
    assert prec("fp8(format=hybrid)") == h


def test_fp8_block_deepseek_layout():
    p = prec("fp8_block")
    assert p.weight.block == (128, 128) and p.activation.block == (1, 128) and p.grad.block == (1, 128)
    assert p.weight.scale_dtype == "pow2"  # TE Float8BlockScaling default
    assert prec("fp8_block(scales=fp32)").weight.scale_dtype == "fp32"
    assert prec("fp8_block(fp32)").activation.scale_dtype == "fp32"
    assert p.backward == BackwardMode.QUANTIZED


def test_mxfp8():
    p = prec("mxfp8")
    assert (p.weight.kind, p.weight.element, p.weight.block, p.weight.scale_dtype) == \
        (FormatKind.MXFP8, "e4m3", (1, 32), "e8m0")
    assert p.activation.block == (1, 32) and p.grad.element == "e4m3" and p.backward == BackwardMode.QUANTIZED
    p2 = prec("mxfp8(elem=e4m3, grad_elem=e5m2, weight_block=32x32)")
    assert p2.weight.block == (32, 32) and p2.activation.block == (1, 32) and p2.grad.element == "e5m2"
    assert prec("mxfp8(e5m2)").grad.element == "e5m2"  # grad element follows elem by default


def test_nvfp4():
    p = prec("nvfp4")
    assert (p.weight.kind, p.weight.element, p.weight.block, p.weight.scale_dtype, p.weight.global_scale) == \
        (FormatKind.NVFP4, "e2m1", (1, 16), "e4m3", "tensor")
    assert p.activation.global_scale == "tensor" and p.grad.kind == FormatKind.BF16
    assert p.backward == BackwardMode.HIGH_PRECISION  # default backward of nvfp4
    q = prec("nvfp4(act_scale=per_token, weight_scale=per_expert, weight_block=16x16)")
    assert q.activation.global_scale == "row" and q.weight.global_scale == "expert" and q.weight.block == (16, 16)
    assert q.activation.block == (1, 16)


@pytest.mark.parametrize("rhs,mode", [("mxfp8 backward=high_precision", "high_precision"),
                                      ("mxfp8, backward=dequantized", "dequantized"),
                                      ("nvfp4 backward=dequantized", "dequantized"),
                                      ("fp8_block backward=quantized", "quantized")])
def test_backward_modes(rhs, mode):
    p = prec(rhs)
    assert p.backward.value == mode
    if mode != "quantized":
        assert p.grad.kind == FormatKind.BF16  # bf16 gradient GEMMs


def test_per_operand_formats():
    p = prec("weight=nvfp4(weight_block=16x16), act=bf16")
    assert p.weight.kind == FormatKind.NVFP4 and p.weight.block == (16, 16)
    assert p.activation.kind == FormatKind.BF16 and p.grad.kind == FormatKind.BF16
    assert p.backward == BackwardMode.HIGH_PRECISION
    q = prec("mxfp8 act=bf16")  # base + override
    assert q.weight.kind == FormatKind.MXFP8 and q.activation.kind == FormatKind.BF16
    r = prec("weight=mxfp8, act=mxfp8, grad=mxfp8(grad_elem=e5m2)")
    assert r.grad.element == "e5m2" and r.backward == BackwardMode.QUANTIZED
    assert prec("weight=fp8").backward == BackwardMode.HIGH_PRECISION  # no quantized grads -> hp backward


@pytest.mark.parametrize("rhs,arg,msg,hint", [
    ("nvfp5", None, "unknown format 'nvfp5'", "did you mean 'nvfp4'?"),
    ("nvfp4(act_scale=per_tokn)", "act_scale", "invalid value 'per_tokn'", "per_token"),
    ("nvfp4(actscale=per_token)", "actscale", "unknown argument 'actscale'", "act_scale"),
    ("nvfp4(per_token)", "_0", "takes only keyword arguments", "nvfp4(act_scale=per_token)"),
    ("bf16(x)", "_0", "takes no arguments", "bf16"),
    ("bf16(x=1)", "x", "unknown argument 'x'", "takes no arguments"),
    ("mxfp8(e4m3, e5m2)", "_1", "takes only keyword", "mxfp8"),
    ("mxfp8(elem=e4m3, elem=e5m2)", "elem", "given twice", "remove"),
    ("mxfp8(weight_block=16x16)", "weight_block", "invalid value '16x16'", "32x32"),
    ("fp8_block(scales=ue8m0)", "scales", "invalid value 'ue8m0'", "pow2"),
    ("weight=nvfp4(act_scale=per_token)", "act_scale", "has no effect in weight=", "act="),
    ("act=nvfp4(weight_block=16x16)", "weight_block", "has no effect in act=", "weight="),
    ("nvfp4 backward=quantized", "backward", "not supported for nvfp4", "dequantized"),
    ("mxfp8 backward=quantised", "backward", "unknown backward mode", "quantized"),
    ("bf16 backward=dequantized", "backward", "only applies to quantized", "remove backward="),
    ("weight=mxfp8 backward=quantized", "backward", "needs quantized gradients", "grad="),
    ("mxfp8 grad=mxfp8 backward=dequantized", "grad", "needs backward=quantized", "drop grad="),
    ("nvfp4 grad=nvfp4", "grad", "nvfp4 gradients are not supported", "bf16"),
    ("weight=nvfp4, act=mxfp8", "act", "cannot be mixed", "same quantized format"),
    ("mxfp8 grad=fp8", "grad", "differs from forward", "one format family"),
    ("grad=mxfp8", "grad", "need a quantized forward", "drop grad="),
])
def test_format_errors(rhs, arg, msg, hint):
    e = ferr(rhs)
    assert msg in str(e) and hint in e.hint and e.arg == arg
    assert e.span is not None and e.span.file == "f.policy" and e.span.line == 2


def test_error_span_points_at_the_argument():
    e = ferr("nvfp4(act_scale=per_token, weight_scale=per_tokn)")
    assert e.span.col == len("    attn: nvfp4(act_scale=per_token, ") + 1


def test_every_format_has_an_argument_table():
    assert set(FORMAT_ARGS) == {"bf16", "fp16", "fp32", "fp8", "fp8_block", "mxfp8", "nvfp4"}
