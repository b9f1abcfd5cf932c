"""Format calls of the policy language -> `precision.Precision`.

    bf16 | fp16 | fp32                                      high precision (no arguments)
    fp8(e4m3 | hybrid)                                      per-tensor current scaling (TE Float8CurrentScaling)
    fp8_block(scales=pow2 | fp32)                           DeepSeek-V3 / TE Float8BlockScaling
    mxfp8(elem=e4m3|e5m2, grad_elem=e4m3|e5m2, weight_block=1x32|32x32)
    nvfp4(act_scale=per_token|per_tensor, weight_scale=per_tensor|per_expert, weight_block=1x16|16x16)

plus, at rule level, `weight=<call>`, `act=<call>`, `grad=<call>` and `backward=quantized|high_precision|dequantized`.
The full table (defaults, backward modes, what maps to which TensorFormat) is in docs/LANGUAGE.md; the facts come
from ../shared/research/quantizers.md (TE 2.14 recipes, DeepSeek-V3 inference/kernel.py, OCP MX v1.0).

Errors are `precision.FormatError(message, hint, arg)` with an extra `.span` attribute (the AST span of the
offending argument or call) so the resolver can point a caret at it.
"""

from __future__ import annotations

from typing import Optional

from ..diagnostics import did_you_mean
from ..precision import (
    BF16,
    BackwardMode,
    FormatError,
    FormatKind,
    HIGH_PRECISION_KINDS,
    QUANTIZED_BACKWARD_KINDS,
    Precision,
    TensorFormat,
    hp,
)
from . import ast

HIGH_PRECISION_NAMES = ("bf16", "fp16", "fp32")
FORMAT_NAMES = HIGH_PRECISION_NAMES + ("fp8", "fp8_block", "mxfp8", "nvfp4")
BACKWARD_NAMES = tuple(m.value for m in BackwardMode)

# Accepted arguments per format: name -> allowed values; the first listed value is the default.
# The positional argument (if any) is an alias for the named one in _POSITIONAL.
FORMAT_ARGS: dict[str, dict[str, tuple[str, ...]]] = {
    "bf16": {}, "fp16": {}, "fp32": {},
    # TE Float8CurrentScaling: HYBRID = E4M3 forward, E5M2 gradients.
    "fp8": {"format": ("e4m3", "hybrid")},
    # TE Float8BlockScaling defaults to power-of-2 scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 turns that off);
    # DeepSeek-V3 checkpoints store plain fp32 scale_inv.
    "fp8_block": {"scales": ("pow2", "fp32")},
    # TE MXFP8BlockScaling: 32-element E8M0 blocks; enable_2d_quantization = 32x32 forward weight blocks.
    "mxfp8": {"elem": ("e4m3", "e5m2"), "grad_elem": ("e4m3", "e5m2"), "weight_block": ("1x32", "32x32")},
    # NVFP4: E2M1 values, E4M3 scale per 16 values, FP32 second-level scale (per tensor, or per token for
    # activations as in Miles' per-token NVFP4); gradients stay BF16.
    "nvfp4": {"act_scale": ("per_tensor", "per_token"), "weight_scale": ("per_tensor", "per_expert"),
              "weight_block": ("1x16", "16x16")},
}
_POSITIONAL = {"fp8": "format", "fp8_block": "scales", "mxfp8": "elem"}
# Which arguments make sense for which operand (used to reject e.g. weight=nvfp4(act_scale=per_token)).
_OPERAND_OF_ARG = {"act_scale": "act", "weight_scale": "weight", "weight_block": "weight", "grad_elem": "grad"}
# Default backward mode per format (see docs/LANGUAGE.md "Backward modes").
DEFAULT_BACKWARD = {
    "fp8": BackwardMode.QUANTIZED, "fp8_block": BackwardMode.QUANTIZED, "mxfp8": BackwardMode.QUANTIZED,
    "nvfp4": BackwardMode.HIGH_PRECISION,
}


def _error(message: str, hint: str, arg: Optional[str], span: Optional[ast.Span]) -> FormatError:
    err = FormatError(message, hint=hint, arg=arg)
    err.span = span  # type: ignore[attr-defined]
    return err


def _args(call: ast.FormatCall, operand: Optional[str]) -> dict[str, str]:
    """Validate a call's arguments; return {arg: value} with defaults filled in."""
    if call.name not in FORMAT_ARGS:
        raise _error(f"unknown format '{call.name}'", did_you_mean(call.name, FORMAT_NAMES, "format"), None,
                     call.span)
    allowed = FORMAT_ARGS[call.name]
    out: dict[str, str] = {}
    for a in call.args:
        key = a.key
        if key.startswith("_"):
            pos = _POSITIONAL.get(call.name)
            if pos is None or key != "_0":
                what = "takes no arguments" if not allowed else f"takes only keyword arguments ({', '.join(allowed)})"
                raise _error(f"'{call.name}' {what}", f"e.g. {_example(call.name)}", key, a.span)
            key = pos
        if key not in allowed:
            hint = (f"'{call.name}' takes no arguments" if not allowed else
                    did_you_mean(key, allowed, f"{call.name} argument"))
            raise _error(f"unknown argument '{key}' for {call.name}", hint, key, a.span)
        if key in out:
            raise _error(f"argument '{key}' given twice", "remove one of them", key, a.span)
        value = str(a.value)
        if value not in allowed[key]:
            raise _error(f"invalid value '{value}' for {call.name}({key}=...)",
                         did_you_mean(value, allowed[key], key), key, a.span)
        owner = _OPERAND_OF_ARG.get(key)
        if operand is not None and owner is not None and owner != operand:
            raise _error(f"'{key}' has no effect in {operand}={call.name}(...)",
                         f"'{key}' configures the {owner} operand: move it to {owner}=... or to the base format",
                         key, a.span)
        out[key] = value
    for key, values in allowed.items():
        out.setdefault(key, values[0])
    return out


def _example(name: str) -> str:
    return {"fp8": "fp8(hybrid)", "fp8_block": "fp8_block(scales=fp32)", "mxfp8": "mxfp8(elem=e4m3)",
            "nvfp4": "nvfp4(act_scale=per_token)"}.get(name, name)


def _dims(text: str) -> tuple[int, int]:
    r, c = text.split("x")
    return int(r), int(c)


def operand_formats(call: ast.FormatCall, operand: Optional[str] = None) -> tuple[TensorFormat, TensorFormat,
                                                                                    TensorFormat]:
    """(weight, activation, grad) formats of one call. `operand` (weight|act|grad) restricts which arguments are
    meaningful (an act-only argument in `weight=` is an error)."""
    args = _args(call, operand)
    name = call.name
    if name in HIGH_PRECISION_NAMES:
        f = hp(name)
        return f, f, f
    if name == "fp8":
        fwd = TensorFormat(kind=FormatKind.FP8, element="e4m3", scale_dtype="fp32", global_scale="tensor")
        grad_elem = "e5m2" if args["format"] == "hybrid" else "e4m3"
        return fwd, fwd, TensorFormat(kind=FormatKind.FP8, element=grad_elem, scale_dtype="fp32",
                                      global_scale="tensor")
    if name == "fp8_block":
        sd = args["scales"]
        return (TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(128, 128), scale_dtype=sd),
                TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype=sd),
                TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype=sd))
    if name == "mxfp8":
        elem = args["elem"]
        grad_elem = next((str(a.value) for a in call.args if a.key == "grad_elem"), elem)
        wblock = _dims(args["weight_block"])
        return (TensorFormat(kind=FormatKind.MXFP8, element=elem, block=wblock, scale_dtype="e8m0"),
                TensorFormat(kind=FormatKind.MXFP8, element=elem, block=(1, 32), scale_dtype="e8m0"),
                TensorFormat(kind=FormatKind.MXFP8, element=grad_elem, block=(1, 32), scale_dtype="e8m0"))
    # nvfp4
    w_scope = {"per_tensor": "tensor", "per_expert": "expert"}[args["weight_scale"]]
    a_scope = {"per_tensor": "tensor", "per_token": "row"}[args["act_scale"]]
    weight = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=_dims(args["weight_block"]), scale_dtype="e4m3",
                          global_scale=w_scope)  # type: ignore[arg-type]
    act = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3",
                       global_scale=a_scope)  # type: ignore[arg-type]
    return weight, act, BF16


def precision_from_spec(spec: ast.PrecisionSpec) -> Precision:
    """Map a rule's right-hand side to a Precision. Raises FormatError (with .arg and .span) on any problem."""
    w = a = g = None
    explicit_grad = None
    kinds_named: list[str] = []
    if spec.base is not None:
        w, a, g = operand_formats(spec.base)
        kinds_named.append(spec.base.name)
    for operand, call in (("weight", spec.weight), ("act", spec.act), ("grad", spec.grad)):
        if call is None:
            continue
        fw, fa, fg = operand_formats(call, operand)
        kinds_named.append(call.name)
        if operand == "weight":
            w = fw
        elif operand == "act":
            a = fa
        else:
            if call.name == "nvfp4":
                raise _error("nvfp4 gradients are not supported", "NVFP4 recipes keep gradients in bf16 "
                             "(Miles/TE high-precision or dequantized backward): drop grad=nvfp4", "grad", call.span)
            g = fg
            explicit_grad = call
    w = w or BF16
    a = a or BF16
    g = g or BF16
    _check_operand_kinds(spec, w, a, g)

    quantized = [f for f in (w, a, g) if f.is_quantized]
    has_nvfp4 = any(f.kind == FormatKind.NVFP4 for f in (w, a))
    if spec.backward is not None:
        if spec.backward not in BACKWARD_NAMES:
            raise _error(f"unknown backward mode '{spec.backward}'", did_you_mean(spec.backward, BACKWARD_NAMES,
                         "backward"), "backward", spec.backward_span)
        if not quantized:
            raise _error("backward= only applies to quantized formats", "high-precision layers always run the "
                         "backward in high precision: remove backward=", "backward", spec.backward_span)
        backward = BackwardMode(spec.backward)
    elif has_nvfp4:
        backward = DEFAULT_BACKWARD["nvfp4"]
    elif g.is_quantized:
        backward = BackwardMode.QUANTIZED
    else:
        backward = BackwardMode.HIGH_PRECISION

    if backward == BackwardMode.QUANTIZED:
        if has_nvfp4:
            raise _error("backward=quantized is not supported for nvfp4", "NVFP4 recipes run the backward in bf16: "
                         "use backward=high_precision or backward=dequantized", "backward",
                         spec.backward_span or spec.span)
        if not g.is_quantized:
            raise _error("backward=quantized needs quantized gradients", "give a quantized base format (e.g. mxfp8) "
                         "or grad=mxfp8 / grad=fp8(hybrid)", "backward", spec.backward_span or spec.span)
        if g.kind not in QUANTIZED_BACKWARD_KINDS:  # pragma: no cover - nvfp4 grads rejected above
            raise _error(f"quantized backward is not available for {g.kind.value}", "use fp8, fp8_block or mxfp8",
                         "backward", spec.backward_span)
    elif g.is_quantized:
        if explicit_grad is not None:
            raise _error(f"grad={explicit_grad.name} needs backward=quantized",
                         f"with backward={backward.value} the gradient GEMMs run in bf16: drop grad= or set "
                         "backward=quantized", "grad", explicit_grad.span)
        g = BF16  # hp / dequantized backward: gradients stay bf16 (the base format's grad part does not apply)
    if not quantized:
        return Precision(weight=w, activation=a, grad=g, backward=BackwardMode.HIGH_PRECISION)
    return Precision(weight=w, activation=a, grad=g, backward=backward)


def _check_operand_kinds(spec: ast.PrecisionSpec, w: TensorFormat, a: TensorFormat, g: TensorFormat) -> None:
    # One GEMM runs in one low-precision family: W and A may differ only if one of them is high precision.
    if w.is_quantized and a.is_quantized and w.kind != a.kind:
        where = spec.act or spec.weight or spec.base
        raise _error(f"weight format {w.kind.value} and activation format {a.kind.value} cannot be mixed in one GEMM",
                     "use the same quantized format for weight and act, or keep one of them high precision "
                     "(e.g. weight=nvfp4, act=bf16)", "act" if spec.act else "weight", where.span if where else None)
    if g.is_quantized and (w.is_quantized or a.is_quantized):
        fwd = w if w.is_quantized else a
        if g.kind != fwd.kind:
            raise _error(f"gradient format {g.kind.value} differs from forward format {fwd.kind.value}",
                         "quantized backward GEMMs mix the gradient with forward operands: use one format family",
                         "grad", spec.grad.span if spec.grad else spec.span)
    if w.kind in HIGH_PRECISION_KINDS and a.kind in HIGH_PRECISION_KINDS and g.is_quantized and spec.grad:
        raise _error("quantized gradients need a quantized forward", "quantize weight/act too, or drop grad=",
                     "grad", spec.grad.span)


def is_high_precision_spec(spec: ast.PrecisionSpec) -> bool:
    return not precision_from_spec(spec).is_quantized
