"""Format calls of the policy language -> `precision.Precision`.

    bf16 | fp16 | fp32                                      high precision (no arguments)
    fp8(e4m3 | hybrid)                                      per-tensor current scaling (TE Float8CurrentScaling)
    fp8_block(scales=pow2 | fp32)                           DeepSeek-V3 / TE Float8BlockScaling
    mxfp8(elem=e4m3|e5m2, grad_elem=e4m3|e5m2, weight_block=1x32|32x32)
    nvfp4(act_scale=per_token|per_tensor, weight_scale=per_tensor|per_expert, weight_block=1x16|16x16)

plus, at rule level, `weight=<call>`, `act=<call>`, `grad=<call>` and `backward=quantized|high_precision|dequantized`.
The full table (defaults, backward modes, what maps to which TensorFormat) is in docs/LANGUAGE.md; the facts (TE 2.14
recipes, DeepSeek-V3 inference/kernel.py, OCP MX v1.0) are the format specs' (precision_dsl/format_specs.py).

Errors are `precision.FormatError(message, hint, arg)` with an extra `.span` attribute (the AST span of the
offending argument or call) so the resolver can point a caret at it.
"""

from __future__ import annotations

from typing import Optional

from ..diagnostics import did_you_mean
from ..precision import (
    BF16,
    SPECS,
    BackwardMode,
    FormatError,
    Precision,
    TensorFormat,
    spec_of,
)
from . import ast

# The language's vocabulary is the format specs' (precision_dsl.format_specs): names, arguments and their values (the
# first listed value is the default), the positional alias, which operand an argument configures, the default
# backward mode.
HIGH_PRECISION_NAMES = tuple(s.name for s in SPECS.values() if s.high_precision)
FORMAT_NAMES = tuple(s.name for s in SPECS.values())
BACKWARD_NAMES = tuple(m.value for m in BackwardMode)
FORMAT_ARGS: dict[str, dict[str, tuple[str, ...]]] = {s.name: dict(s.args) for s in SPECS.values()}


def _error(message: str, hint: str, arg: Optional[str], span: Optional[ast.Span]) -> FormatError:
    err = FormatError(message, hint=hint, arg=arg)
    err.span = span  # type: ignore[attr-defined]
    return err


def _args(call: ast.FormatCall, operand: Optional[str]) -> tuple[dict[str, str], frozenset[str]]:
    """Validate a call's arguments; return ({arg: value} with defaults filled in, the names the call gave)."""
    if call.name not in FORMAT_ARGS:
        raise _error(f"unknown format '{call.name}'", did_you_mean(call.name, FORMAT_NAMES, "format"), None,
                     call.span)
    spec = spec_of(call.name)
    allowed = spec.args
    out: dict[str, str] = {}
    for a in call.args:
        key = a.key
        if key.startswith("_"):
            pos = spec.positional
            if pos is None or key != "_0":
                what = "takes no arguments" if not allowed else f"takes only keyword arguments ({', '.join(allowed)})"
                raise _error(f"'{call.name}' {what}", f"e.g. {spec.example}", key, a.span)
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
        owner = spec.arg_operand.get(key)
        if operand is not None and owner is not None and owner != operand:
            raise _error(f"'{key}' has no effect in {operand}={call.name}(...)",
                         f"'{key}' configures the {owner} operand: move it to {owner}=... or to the base format",
                         key, a.span)
        out[key] = value
    given = frozenset(out)
    for key, values in allowed.items():
        out.setdefault(key, values[0])
    return out, given


def operand_formats(call: ast.FormatCall, operand: Optional[str] = None) -> tuple[TensorFormat, TensorFormat,
                                                                                    TensorFormat]:
    """(weight, activation, grad) formats of one call. `operand` (weight|act|grad) restricts which arguments are
    meaningful (an act-only argument in `weight=` is an error)."""
    args, given = _args(call, operand)
    w, a, g = spec_of(call.name).operands(args, given)
    return TensorFormat(**w), TensorFormat(**a), TensorFormat(**g)


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
            call_spec = spec_of(call.name)
            if not (call_spec.high_precision or call_spec.quantized_backward):
                raise _error(f"{call.name} gradients are not supported", call_spec.no_grad_hint, "grad", call.span)
            g = fg
            explicit_grad = call
    w = w or BF16
    a = a or BF16
    g = g or BF16
    _check_operand_kinds(spec, w, a, g)

    quantized = [f for f in (w, a, g) if f.is_quantized]
    # a forward format without a quantized backward (nvfp4) decides the default and refuses backward=quantized
    no_qbwd = next((f.spec for f in (w, a) if f.is_quantized and not f.spec.quantized_backward), None)
    if spec.backward is not None:
        if spec.backward not in BACKWARD_NAMES:
            raise _error(f"unknown backward mode '{spec.backward}'", did_you_mean(spec.backward, BACKWARD_NAMES,
                         "backward"), "backward", spec.backward_span)
        if not quantized:
            raise _error("backward= only applies to quantized formats", "high-precision layers always run the "
                         "backward in high precision: remove backward=", "backward", spec.backward_span)
        backward = BackwardMode(spec.backward)
    elif no_qbwd is not None:
        backward = BackwardMode(no_qbwd.default_backward)
    elif g.is_quantized:
        backward = BackwardMode.QUANTIZED
    else:
        backward = BackwardMode.HIGH_PRECISION

    if backward == BackwardMode.QUANTIZED:
        if no_qbwd is not None:
            raise _error(f"backward=quantized is not supported for {no_qbwd.name}", no_qbwd.no_quantized_backward_hint,
                         "backward", spec.backward_span or spec.span)
        if not g.is_quantized:
            raise _error("backward=quantized needs quantized gradients", "give a quantized base format (e.g. mxfp8) "
                         "or grad=mxfp8 / grad=fp8(hybrid)", "backward", spec.backward_span or spec.span)
        if not g.spec.quantized_backward:  # pragma: no cover - nvfp4 grads rejected above
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
    if not w.is_quantized and not a.is_quantized and g.is_quantized and spec.grad:
        raise _error("quantized gradients need a quantized forward", "quantize weight/act too, or drop grad=",
                     "grad", spec.grad.span)


def is_high_precision_spec(spec: ast.PrecisionSpec) -> bool:
    return not precision_from_spec(spec).is_quantized
