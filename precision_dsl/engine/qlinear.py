"""Plan-driven quantized linears for the trainer (emulated: quantize -> dequantize -> FP32 GEMM).

For every GEMM weight the plan's `TensorPlan.precision` gives the weight / activation / gradient formats and the
backward mode. `QLinearFunction` implements the forward and the three backward rules of TransformerEngine's
`NVTE_BACKWARD_OVERRIDE` (NVIDIA/TransformerEngine#2644; TE 2.20.2 common/recipe/__init__.py `backward_override`):

  forward          y  = Q_a(x) @ Q_w(W)^T                   (Q = fake quantization in the plan's format)
  high_precision   dx = g @ W_bf16,         dW = g^T @ x_bf16         (backward on the ORIGINAL BF16 operands)
  dequantized      dx = g @ B(Q_w(W)),      dW = g^T @ B(Q_a(x))      (backward on the BF16 dequantization B of the
                   forward's operands: TE 2.20.2 module/linear.py and grouped_linear.py call
                   `dequantize(dtype=activation_dtype)` on the saved input and weight; B rounds the fp32 dequantized
                   value once to bf16, RNE - a no-op for MXFP8 (<= 4 significant bits x 2^k), a real rounding for
                   NVFP4's and FP8's fp32 second-level scales)
  quantized        dx = Q_g(g) @ Q_w^col(W), dW = Q_g^col(g)^T @ Q_a^col(x)
                   (fp8 / mxfp8 grads; columnwise copies are quantized independently from the BF16 operand, as TE
                   does, with blocks along the contraction dim of each backward GEMM)

Weights: quantized once per optimizer step from BF16(master) (`quantize_weights`), honouring share-scale groups
(NVFP4 gate+up of one expert use one global amax = max of the members' amax). Activations: the plan's scope
(per token = one FP32 scale per row; per expert / per tensor = one scale over the GEMM's input). The master weight
receives dW straight through (the quantizer has no gradient of its own), like Megatron's FP32 main params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import kernels
from ..formats import fp8_block, fp8_block_pow2
from ..plan import Plan
from ..precision import BF16, BackwardMode, FormatKind, Scope, TensorFormat, is_per_token
from . import fastgemm, grouped_experts, numerics
from ..formats.base import QuantizedTensor

BF16_FMT = BF16

# The fast path's native operand layouts, by name: (kind, block). One table; `_has_layout` reads it.
_LAYOUTS = {
    "fp8_tile": (FormatKind.FP8_BLOCK, (128, 128)),  # DeepSeek-V3 / TE Float8BlockScaling weights
    "fp8_row": (FormatKind.FP8_BLOCK, (1, 128)),  # ... and its activations / gradients
    "mxfp8_row": (FormatKind.MXFP8, (1, 32)),  # MXFP8 rowwise (the kernels' one-read row + column copies)
}


def _has_layout(fmt: TensorFormat, name: str, block_unset_matches: bool = True) -> bool:
    """Whether `fmt` is the named native layout (a format without a block reads as that layout's block, unless
    `block_unset_matches` is False)."""
    kind, block = _LAYOUTS[name]
    return fmt.kind == kind and tuple(fmt.block or (block if block_unset_matches else ())) == block


@dataclass(frozen=True)
class LinearSpec:
    hf_name: str
    weight: TensorFormat
    activation: TensorFormat
    grad: TensorFormat
    backward: BackwardMode
    group: Optional[str] = None
    act_partitions: int = 1  # expert-TP ranks splitting this GEMM's input along K (row-parallel expert down_proj)


def linear_specs(plan: Plan, etp: int = 1) -> dict[str, LinearSpec]:
    """One LinearSpec per GEMM weight of the plan; validates what the engine can execute. `etp` emulates expert
    tensor parallelism for activation scales: routed-expert down_proj is row-parallel, so its input is split along K
    over `etp` ranks (gate/up are column-parallel: their input is whole on every rank)."""
    out = {}
    for t in plan.tensors:
        if not t.is_linear:
            continue
        p = t.precision
        if p.backward == BackwardMode.QUANTIZED and p.grad.is_quantized and not p.grad.spec.quantized_backward:
            raise numerics.EngineFormatError(
                f"{t.hf_name}: backward=quantized with {p.grad.short()} gradients is not supported (quantized "
                "backward is fp8 / fp8_block / mxfp8 only; hint: use backward=dequantized or high_precision)")
        parts = etp if t.role == "routed_experts.down" else 1
        out[t.hf_name] = LinearSpec(t.hf_name, p.weight, p.activation, p.grad, p.backward, t.share_scale_group, parts)
    return out


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# weights: one quantization per optimizer step (shared with the weight-update sender)
# ---------------------------------------------------------------------------------------------------------------
def group_amaxes(plan: Plan, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Share-scale group id -> the group's NVFP4 global amax (max over members, of the BF16 weights)."""
    out = {}
    for g in plan.share_scale_groups:
        members = [_bf16(weights[m].detach()) for m in g.members if m in weights]
        if members:
            out[g.id] = numerics.group_amax(members)
    return out


@torch.no_grad()
def quantize_weights(plan: Plan, weights: dict[str, torch.Tensor],
                     bf16_out: Optional[dict] = None, dequant_out: Optional[dict] = None) -> dict[str, object]:
    """hf_name -> QuantizedTensor (quantized linears) or a BF16 tensor (everything else), from BF16(master).
    This is the trainer's forward weight; the weight-update sender must produce the same bytes. `bf16_out`, if
    given, receives each quantized weight's BF16(master) (the trainer's backward operand), made here once;
    `dequant_out`, if given, receives the fp32 dequantization of the weights quantized in a stack (one decode of
    the stack; the caller dequantizes the others)."""
    by_name = plan.by_name()
    amax = group_amaxes(plan, weights)
    out: dict[str, object] = {}
    done = _quantize_tiled_groups(by_name, weights, out, bf16_out)
    done |= _quantize_row_scaled_groups(by_name, weights, amax, out, bf16_out, dequant_out)
    for name, w in weights.items():
        if name in done:
            continue
        tp = by_name.get(name)
        if tp is None:
            raise KeyError(f"{name}: tensor is not in the plan (plan for {plan.model})")
        fmt = tp.precision.weight
        w16 = w.detach().to(torch.bfloat16)
        if tp.is_linear and fmt.is_quantized:
            ga = amax.get(tp.share_scale_group) if fmt.spec.takes_global_amax else None
            out[name] = numerics.quantize(w16, fmt, global_amax=ga, what=name)
            if bf16_out is not None:
                bf16_out[name] = w16
        else:  # .to() made a new tensor unless the master is BF16 already: then a copy, not an alias of it
            out[name] = w16.clone() if w16.data_ptr() == w.data_ptr() else w16
    return out


def _row_scaled(fmt: TensorFormat) -> Optional[TensorFormat]:
    """For a weight format with ONE second-level scale per tensor over 1-row blocks (NVFP4 1x16, per tensor or per
    share-scale group), the same format with that scale per row: given each row its tensor's amax, it computes
    every row exactly as the per-tensor quantization does (the scales are elementwise in the amax). None: other
    formats."""
    if not (fmt.is_quantized and fmt.spec.takes_global_amax) or is_per_token(fmt) \
            or fmt.spec.block_rows(fmt, "row") != 1:
        return None
    return fmt.model_copy(update={"global_scale": Scope.PER_TOKEN})


def _quantize_row_scaled_groups(by_name: dict, weights: dict, amax: dict, out: dict, bf16_out: Optional[dict],
                                dequant_out: Optional[dict]) -> set:
    """CPU linears of one per-tensor-scaled NVFP4 format and K (every expert's gate, up and down of all layers)
    quantized as ONE row-scaled stack: their BF16 casts written into one buffer by one multi-tensor copy, each row
    given its tensor's global amax (its share-scale group's, else its own max |BF16(w)|), one quantization and one
    decode instead of one each per tensor (~30 eager ops apiece, every step). Each tensor's bytes, block scales,
    S_dec and G are its rows of the stack's, exactly its own quantization (tests/test_engine_runfast.py; the loop's
    byte check compares them with the sender's per-tensor quantization every step). Non-finite weights keep the
    per-tensor path (its errors). Returns the names done."""
    groups: dict = {}
    for name, w in weights.items():
        tp = by_name.get(name)
        if tp is None or not tp.is_linear or w.dim() != 2 or w.is_cuda:
            continue
        row_fmt = _row_scaled(tp.precision.weight)
        if row_fmt is not None:
            groups.setdefault((w.shape[1], tp.precision.weight, w.device), []).append(name)
    done: set = set()
    for (k, fmt, device), names in groups.items():
        if len(names) < 2:
            continue
        rows = [weights[nm].shape[0] for nm in names]
        stack = torch.empty((sum(rows), k), dtype=torch.bfloat16, device=device)
        w16s = list(stack.split(rows))
        torch._foreach_copy_(w16s, [weights[nm].detach() for nm in names])  # fp32 -> bf16 RN, as .to(bfloat16)
        g = [amax.get(by_name[nm].share_scale_group) for nm in names]
        if fmt.global_scale == Scope.GROUP and None in g:
            continue  # the per-tensor path refuses a group scope without its group's amax
        g = torch.cat([(gi if gi is not None else w16.abs().amax().float()).reshape(1).expand(n)
                       for gi, w16, n in zip(g, w16s, rows)])
        if not bool(torch.isfinite(g).all()):
            continue
        what = f"{names[0]} (+{len(names) - 1} of its K)"
        q = numerics.quantize(stack, _row_scaled(fmt), global_amax=g, what=what)
        deq = numerics.dequantize(q, torch.float32) if dequant_out is not None else None
        r0 = 0
        for nm, n, w16 in zip(names, rows, w16s):
            out[nm] = QuantizedTensor(fmt=fmt, shape=(n, k), data=q.data[r0:r0 + n], scale=q.scale[r0:r0 + n],
                                      global_scale=q.global_scale[r0:r0 + 1], global_amax=q.global_amax[r0:r0 + 1],
                                      axis="row", orig_dtype=torch.bfloat16, kernel=q.kernel)
            if bf16_out is not None:
                bf16_out[nm] = w16
            if deq is not None:
                dequant_out[nm] = deq[r0:r0 + n]
            r0 += n
        done.update(names)
    return done


def _quantize_tiled_groups(by_name: dict, weights: dict, out: dict, bf16_out: Optional[dict]) -> set:
    """FP8 128x128-tiled linears of one shape, format and device (across all layers: every expert's gate and up,
    every down, q with o, k with v) quantized together: their BF16 casts written into one stacked buffer by one
    multi-tensor copy, and ONE quantization of the [G*N, K] stack instead of G (each a kernel launch plus its
    Python: the trainer does this every step). With N % 128 == 0 no tile spans two weights, so each weight's bytes
    and scales are its rows of the stack, exactly its own quantization (tests/test_engine_qlinear.py). An error
    names the stack's first weight. Returns the names done."""
    groups: dict = {}
    for name, w in weights.items():
        tp = by_name.get(name)
        if tp is None or not tp.is_linear or w.dim() != 2 or w.shape[0] % 128:
            continue
        fmt = tp.precision.weight
        if _has_layout(fmt, "fp8_tile", block_unset_matches=False):
            groups.setdefault((tuple(w.shape), fmt, w.device), []).append(name)
    done: set = set()
    for ((n, k), fmt, device), names in groups.items():
        if len(names) < 2:
            continue
        stack = torch.empty((len(names), n, k), dtype=torch.bfloat16, device=device)
        w16s = list(stack.unbind(0))
        torch._foreach_copy_(w16s, [weights[nm].detach() for nm in names])  # fp32 -> bf16 RN, as .to(bfloat16)
        what = f"{names[0]} (+{len(names) - 1} of its shape)"
        q = numerics.quantize(stack.view(len(names) * n, k), fmt, what=what)
        for i, nm in enumerate(names):
            out[nm] = QuantizedTensor(fmt=q.fmt, shape=(n, k), data=q.data[i * n:(i + 1) * n],
                                      scale=q.scale[i * n // 128:(i + 1) * n // 128], axis="row",
                                      orig_dtype=torch.bfloat16, kernel=q.kernel)
            if bf16_out is not None:
                bf16_out[nm] = w16s[i]
        done.update(names)
    return done


# ---------------------------------------------------------------------------------------------------------------
# the autograd function
# ---------------------------------------------------------------------------------------------------------------
def _cached(cache: Optional[dict], key, make):
    if cache is None:
        return make()
    v = cache.get(key)
    if v is None:
        v = cache[key] = make()
    return v


def _ref_input(x2: torch.Tensor, spec: LinearSpec, cache: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hp, x_q) of the reference path: BF16(x) in fp32 and its fake quantization in the activation format.
    `cache`: what was derived from this input for the linears before (q/k/v, an expert's gate and up read one
    tensor: quantized once for all of them, as Megatron's fused linear_qkv / linear_fc1 quantize their input once)."""
    act, parts = spec.activation, spec.act_partitions
    x16 = _cached(cache, "x16", lambda: x2.to(torch.bfloat16))  # the BF16 operand (activations are BF16) ...
    x_hp = _cached(cache, "hp", lambda: x16.float())  # ... its fp32 values for the GEMMs; quantizers take BF16
    if not act.is_quantized:
        return x_hp, x_hp
    return x_hp, _cached(cache, ("q", act, parts),
                         lambda: numerics.fake_quantize_partitioned(x16, act, parts, what=spec.hf_name))


class QLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, w: torch.Tensor, w_fwd: torch.Tensor, spec: LinearSpec,
                cache: Optional[dict] = None):
        """x2 [M, K] fp32, w [N, K] master (fp32), w_fwd [N, K] = the dequantized forward weight (no grad)."""
        x_hp, x_q = _ref_input(x2, spec, cache)
        y = x_q @ w_fwd.t()
        ctx.spec = spec
        if spec.backward == BackwardMode.DEQUANTIZED:  # TE's dequantize(dtype=bf16), see the docstring
            ctx.save_for_backward(_cached(cache, ("bf16", spec.activation, spec.act_partitions), lambda: _bf16(x_q)),
                                  _bf16(w_fwd))
        else:  # high_precision and quantized both start from the BF16 operands
            ctx.save_for_backward(x_hp, _bf16(w.detach()))
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        spec: LinearSpec = ctx.spec
        a, b = ctx.saved_tensors  # (x operand, w operand) per mode
        g = _bf16(gy)  # incoming gradients are BF16 in the trainer
        if spec.backward == BackwardMode.QUANTIZED and spec.grad.is_quantized:
            # dgrad: contraction over N -> g rowwise (blocks along N), W columnwise (blocks along N = W's rows)
            g16 = gy.to(torch.bfloat16)  # quantizers take the BF16 tensors (values = g, a, b exactly)
            g_row = numerics.fake_quantize(g16, spec.grad, axis="row", what=spec.hf_name + " dgrad")
            w_col = numerics.fake_quantize(b.to(torch.bfloat16), spec.weight, axis="col", what=spec.hf_name) \
                if spec.weight.is_quantized else b
            dx = g_row @ w_col
            # wgrad: contraction over M (tokens) -> columnwise copies of g and x (blocks along M)
            g_col = numerics.fake_quantize(g16, spec.grad, axis="col", what=spec.hf_name + " wgrad")
            x_col = numerics.fake_quantize(a.to(torch.bfloat16), spec.activation, axis="col", what=spec.hf_name) \
                if spec.activation.is_quantized else a
            dw = g_col.t() @ x_col
        else:
            dx = g @ b
            dw = g.t() @ a
        return dx, dw, None, None, None


def qlinear(x: torch.Tensor, w: torch.Tensor, w_fwd: torch.Tensor, spec: LinearSpec,
            cache: Optional[dict] = None) -> torch.Tensor:
    """The reference quantized linear; without a backward to come (no_grad, or nothing that needs a gradient: the
    BF16 reference model) just its forward, without the operands only the backward reads."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        y = QLinearFunction.apply(x2, w, w_fwd, spec, cache)
    else:
        y = _ref_input(x2, spec, cache)[1] @ w_fwd.t()
    return y.reshape(*shape[:-1], w.shape[0])


# ---------------------------------------------------------------------------------------------------------------
# the fast path (CUDA): the same contract on tensor cores, native FP8 for fp8_block (fastgemm.py)
# ---------------------------------------------------------------------------------------------------------------
class FastWeight:
    """One GEMM weight of the current optimizer step as the fast path consumes it, built once per step (weights only
    change at the update): BF16(master), the forward operand (bf16 elements + epilogue scale), the stored bytes, and
    the columnwise copy for a quantized backward (built on first use, then cached for the step). The forward
    operand of a quantized weight is decoded on first use: a native FP8 GEMM reads the bytes and never needs it."""

    def __init__(self, w16: torch.Tensor, op: Optional[fastgemm.Op] = None, q: Optional[object] = None):
        if op is None and q is None:
            raise ValueError("FastWeight needs its operand or its quantized bytes")
        self.w16 = w16
        self._op = op
        self.q = q  # formats.QuantizedTensor of the forward weight (None: BF16 weight)
        self.col_q: Optional[object] = None
        self.col_op: Optional[fastgemm.Op] = None
        self._dequant_op: Optional[fastgemm.Op] = None

    def col_tiles(self):
        """The weight's columnwise 128x128 copy for a native dgrad: its rowwise tiles transposed (the same bytes as
        quantizing BF16(master) columnwise; formats/fp8_block.py), once per step."""
        if self.col_q is None:
            self.col_q = fp8_block.transpose_tiles(self.q)
        return self.col_q

    @property
    def dequant_op(self) -> fastgemm.Op:
        """The weight's BF16 dequantization for a dequantized dgrad (TE: `dequantize(dtype=bf16)`), once per step."""
        if self._dequant_op is None:
            self._dequant_op = fastgemm.bf16_dequantized(self.op)
        return self._dequant_op

    @property
    def op(self) -> fastgemm.Op:
        if self._op is None:
            self._op = fastgemm.decode_op(self.q)
        return self._op


def _native_fp8(spec: LinearSpec, native: bool) -> bool:
    """fp8-blockwise-hopper's GEMMs: 1x128 activations x 128x128 weights (DeepSeek-V3 / TE Float8BlockScaling)."""
    return (native and _has_layout(spec.weight, "fp8_tile") and _has_layout(spec.activation, "fp8_row")
            and spec.act_partitions == 1)


def _fake_op(x16: torch.Tensor, fmt: TensorFormat, axis: str = "row", parts: int = 1, what: str = "") -> fastgemm.Op:
    """Op whose dense() is bitwise numerics.fake_quantize(_partitioned)(x16) for a bf16 operand: the fused quantize
    kernel, then the elements decoded straight to bf16 (one-pass decode kernels on a GPU, kernels/triton_decode.py),
    with the second-level scale kept for the epilogue (NVFP4)."""
    if not fmt.is_quantized:
        return fastgemm.Op(x16.to(torch.bfloat16)) if fmt == BF16 \
            else fastgemm.Op(numerics.round_hp(x16.float(), fmt), None, False)
    x = x16
    if parts > 1 and is_per_token(fmt):  # expert-TP: per-partition per-token scales run along K
        return fastgemm.Op(numerics.fake_quantize_partitioned(x, fmt, parts, what=what), None, False)
    x2 = x.reshape(-1, x.shape[-1])
    xp, m = numerics._pad_rows(x2, numerics._block_rows(fmt, axis))
    return fastgemm.decode_op(numerics.quantize(xp, fmt, axis=axis, what=what), rows=m)


def _rowcol_ok(fmt: TensorFormat, x16: torch.Tensor, parts: int = 1) -> bool:
    """MXFP8 1x32 on a GPU the kernels run on: the rowwise and columnwise copies can come from ONE read of x."""
    if not _has_layout(fmt, "mxfp8_row") or parts != 1 or not x16.is_cuda \
            or x16.shape[-1] % 32:
        return False
    return kernels.available()


def _fake_ops_rowcol(x16: torch.Tensor, fmt: TensorFormat) -> tuple[fastgemm.Op, fastgemm.Op]:
    """(_fake_op(x16, fmt, "row"), _fake_op(x16, fmt, "col")) for MXFP8 from one kernel launch over one read of x
    (kernels.mxfp8_quantize_rowcol: the same bytes as the two separate quantizations, tests/test_kernels.py). The
    token dim is zero-padded to whole 32-row blocks as for the columnwise copy alone; rowwise blocks run along K, so
    the padding never touches the real rows' bytes."""
    x2 = x16.reshape(-1, x16.shape[-1])
    xp, m = numerics._pad_rows(x2, 32)
    q_row, q_col = kernels.mxfp8_quantize_rowcol(xp, fmt.element, kernel="triton")
    return fastgemm.decode_op(q_row, rows=m), fastgemm.decode_op(q_col, rows=m)


class SharedInput:
    """One GEMM input as every linear that reads it consumes it: its BF16 copy and each operand derived from it
    (quantized / decoded / columnwise copies) are made ONCE, on first use, however many linears read the input.
    q/k/v read one x and an expert's gate/up read one x: Megatron runs those as one fused GEMM each (linear_qkv,
    linear_fc1) with one input quantization, and so does this (same bytes: the quantizers are deterministic, and a
    quantization depends only on the input and the format). The linears' autograd contexts hold this object, so the
    backward's columnwise copies are shared too, and freed with the graph; the forward-only operands are dropped
    (`forward_done`) once the next input arrives, so the graph keeps only what the backward reads."""

    BACKWARD_KEYS = ("col", "col128")  # derived operands the backward reads (the rest serve the forward only)

    def __init__(self, x2: torch.Tensor):
        # the original BF16 operand (activations are BF16 in the trainer); detached: this object lives outside the
        # autograd graph (each linear's Function returns its own dx)
        self.x16 = x2.detach().to(torch.bfloat16)
        self._derived: dict = {}
        # whether the linears reading it will run a backward (grad mode at the call; inside an autograd Function's
        # forward grad mode is always off): the forward makes backward-only copies only then
        self.backward = True

    def get(self, key: tuple, make):
        v = self._derived.get(key)
        if v is None:
            v = self._derived[key] = make()
        return v

    def put(self, key: tuple, value) -> None:
        self._derived[key] = value

    def forward_done(self) -> None:
        """No further linear reads this input in the forward: free its forward-only operands."""
        self._derived = {k: v for k, v in self._derived.items() if k[0] in self.BACKWARD_KEYS}


def _native_fp8_grad(spec: LinearSpec) -> bool:
    """The backward of a native-FP8 linear is native too: quantized, 1x128 fp8_block gradients."""
    return spec.backward == BackwardMode.QUANTIZED and _has_layout(spec.grad, "fp8_row")


def _fp8_x_operands(xs: SharedInput, spec: LinearSpec):
    """x's rowwise 1x128 FP8 operand for the forward as (q, a_data, a_scale) (fastgemm.fp8_rows16). When a
    backward will run and is native FP8 too, x's columnwise copy for wgrad (zero-padded to whole 128-token blocks)
    comes from the same read of x (fastgemm.fp8_rowcol16, byte for byte the separate quantizations) and waits in
    `xs` for it, as TE quantizes both directions of the input in the forward."""
    act = spec.activation
    if not (_native_fp8_grad(spec) and xs.backward):  # no native backward to feed (or none at all: no_grad)
        return fastgemm.fp8_rows16(xs.x16, act, spec.hf_name)
    q, data, scale, q_col = fastgemm.fp8_rowcol16(xs.x16, act)
    xs.put(("col128", act), q_col)
    return q, data, scale


class FastQLinearFunction(torch.autograd.Function):
    """QLinearFunction's contract (same operands bit for bit, fp32 accumulation) with tensor-core GEMMs; fp8_block
    operands run as native FP8 GEMMs where cuBLASLt takes them. Saves bf16 / quantized operands, not fp32 copies."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, w: torch.Tensor, fw: FastWeight, spec: LinearSpec, ex: "TrainerExecutor",
                xs: Optional[SharedInput] = None):
        stats = ex.stats
        xs = xs if xs is not None else SharedInput(x2)
        x16 = xs.x16
        act = spec.activation
        ctx.spec, ctx.fw, ctx.ex, ctx.xs, ctx.x_col = spec, fw, ex, xs, None
        y = None
        if _native_fp8(spec, ex.native) and fw.q is not None:
            qx, a_data, a_scale = xs.get(("q16", act), lambda: _fp8_x_operands(xs, spec))
            y = ex.fp8(a_data, a_scale, (1, 128), fw.q.data, fw.q.scale, (128, 128), act.element,
                       spec.weight.element, stats)
            if y is not None:
                y = y[:x16.shape[0]]
            else:
                y = fastgemm.mm(xs.get(("op", act, 1), lambda: fastgemm.decode_op(qx)), fw.op)
                stats.add(fastgemm.FP8_FALLBACK)
            xa = None
        else:
            if spec.backward == BackwardMode.QUANTIZED and spec.grad.is_quantized \
                    and _rowcol_ok(act, x16, spec.act_partitions):
                # quantized backward needs x's columnwise copy: made now, with the rowwise one, from one read of x
                # (TE quantizes both directions in the forward too); the backward then needs nothing else of x
                xa, ctx.x_col = xs.get(("rowcol", act), lambda: _fake_ops_rowcol(x16, act))
            else:
                xa = xs.get(("op", act, spec.act_partitions),
                            lambda: _fake_op(x16, act, parts=spec.act_partitions, what=spec.hf_name)) \
                    if act.is_quantized else fastgemm.Op(x16)
            y = fastgemm.mm(xa, fw.op, stats)
        if spec.backward == BackwardMode.DEQUANTIZED:
            if xa is None:
                xa = xs.get(("op", act, 1), lambda: fastgemm.decode_op(qx))
            op = xa
            # TE's dequantize(dtype=bf16) of the saved input
            ctx.xa = xs.get(("bf16-dequantized", act, spec.act_partitions), lambda: fastgemm.bf16_dequantized(op))
            ctx.xs = None
        elif ctx.x_col is not None:
            ctx.xs = None  # the backward needs nothing else of x
        else:  # saved as well: autograd's in-place check (x16 aliases x when x is BF16 already)
            ctx.save_for_backward(x16)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        spec: LinearSpec = ctx.spec
        fw: FastWeight = ctx.fw
        ex = ctx.ex
        stats = ex.stats
        g16 = gy.to(torch.bfloat16)  # incoming gradients are BF16 in the trainer
        if spec.backward == BackwardMode.DEQUANTIZED:
            xa = ctx.xa
            del ctx.xa
            dx = fastgemm.mm(fastgemm.Op(g16), fw.dequant_op.t(), stats)
            dw = fastgemm.mm(fastgemm.Op(g16.t()), xa.t(), stats)
            return dx, dw, None, None, None, None
        x_col, ctx.x_col = ctx.x_col, None  # made in the forward (MXFP8 row + col from one read), else below
        xs, ctx.xs = ctx.xs, None
        x16 = None if xs is None else ctx.saved_tensors[0]  # == xs.x16 (saved: autograd checks it was not modified)
        if spec.backward == BackwardMode.QUANTIZED and spec.grad.is_quantized:
            if _native_fp8(spec, ex.native) and _native_fp8_grad(spec):
                return (*_native_fp8_backward(g16, xs, fw, spec, ex), None, None, None, None)
            # dgrad (contraction over N): g rowwise x the weight's columnwise copy; wgrad (over M): columnwise copies
            if _rowcol_ok(spec.grad, g16):
                g_row, g_col = _fake_ops_rowcol(g16, spec.grad)
            else:
                g_row = _fake_op(g16, spec.grad, what=spec.hf_name + " dgrad")
                g_col = _fake_op(g16, spec.grad, axis="col", what=spec.hf_name + " wgrad")
            dx = fastgemm.mm(g_row, ex.weight_col_op(spec, fw).t(), stats)
            if x_col is None:
                x_col = xs.get(("col", spec.activation), lambda: _fake_op(x16, spec.activation, axis="col",
                                                                         what=spec.hf_name)) \
                    if spec.activation.is_quantized else fastgemm.Op(x16)
            dw = fastgemm.mm(g_col.t(), x_col.t(), stats)
            return dx, dw, None, None, None, None
        dx = fastgemm.mm(fastgemm.Op(g16), fastgemm.Op(fw.w16.t()), stats)
        dw = fastgemm.mm(fastgemm.Op(g16.t()), fastgemm.Op(x16.t()), stats)
        return dx, dw, None, None, None, None


def _native_fp8_backward(g: torch.Tensor, xs: SharedInput, fw: FastWeight, spec: LinearSpec, ex: "TrainerExecutor"):
    """backward=quantized for fp8_block on Hopper: dgrad = Q_g(g)[1x128 along N] x W's columnwise 128x128 copy,
    wgrad = Q_g^col(g)[1x128 along M] x Q_a^col(x)[1x128 along M] (TE Float8BlockScaling), both native FP8 GEMMs;
    a call cuBLASLt refuses is emulated with the same bytes (fp32 GEMM of the dequantized operands)."""
    ew, ea, eg = spec.weight.element, spec.activation.element, spec.grad.element
    stats = ex.stats
    m = g.shape[0]
    # g's rowwise (dgrad) and columnwise (wgrad, tokens zero-padded to whole 128-blocks) copies from one read of g
    qg, g_data, g_scale, qgc = fastgemm.fp8_rowcol16(g, spec.grad)
    w_col = fw.col_tiles()
    dx = ex.fp8(g_data, g_scale, (1, 128), w_col.data, w_col.scale, (128, 128), eg, ew, stats)
    if dx is not None:
        dx = dx[:m]
    else:
        dx = fastgemm.mm(fastgemm.decode_op(qg), fastgemm.decode_op(w_col).t())
        stats.add(fastgemm.FP8_FALLBACK)
    # x's columnwise copy [K, Mp] (zero rows never raise a block amax and add nothing to the sum over M), once for
    # every linear that reads x, quantized without a padded copy of x
    act = spec.activation
    qxc = xs.get(("col128", act), lambda: kernels.fp8_block_quantize(
        xs.x16, act.element, (1, 128), fp8_block_pow2(act), axis="col", fmt=act, pad_rows_to=128))
    dw = ex.fp8(qgc.data, qgc.scale, (1, 128), qxc.data, qxc.scale, (1, 128), eg, ea, stats)
    if dw is None:
        dw = fastgemm.mm(fastgemm.decode_op(qgc, rows=m).t(), fastgemm.decode_op(qxc, rows=m).t())
        stats.add(fastgemm.FP8_FALLBACK)
    return dx, dw


# ---------------------------------------------------------------------------------------------------------------
# executor installed on the trainer model
# ---------------------------------------------------------------------------------------------------------------
GEMM_MODES = ("auto", "fast", "reference")


class TrainerExecutor:
    """The trainer's linear executor: plan-driven quantized linears with per-step cached weights.
    Call `invalidate()` after every optimizer step (the loop does).

    gemm="reference": QLinearFunction (fp32 GEMMs over dequantized operands, the oracle; CPU default).
    gemm="fast": FastQLinearFunction (tensor cores, native FP8 for fp8_block on sm_90; on CPU the same code runs
    fp32 GEMMs and emulates FP8). gemm="auto": fast on CUDA, reference on CPU. `stats` counts GEMMs per path."""

    def __init__(self, plan: Plan, model, etp: int = 1, gemm: str = "auto"):
        if gemm not in GEMM_MODES:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_MODES)}, got {gemm!r}")
        self.plan = plan
        self.specs = linear_specs(plan, etp)
        self.model = model
        self.gemm = gemm
        self._params = dict(model.named_parameters())
        self.quantized: dict[str, object] = {}  # hf_name -> QuantizedTensor of the current step (for checks)
        self._fwd: dict[str, object] = {}  # hf_name -> fp32 dequantized weight (reference) | FastWeight (fast)
        self.stats = fastgemm.GemmStats()
        self.fp8 = fastgemm.NativeFp8Gemm()  # native FP8 GEMMs and the scale layouts they learn (this executor's)
        self._native: Optional[tuple] = None  # (device, native FP8 there?)
        # the last GEMM input seen and its SharedInput: consecutive linears reading the same tensor (q/k/v, an
        # expert's gate/up) share its casts and quantizations; a replaced one keeps only its backward operands
        self._inputs = fastgemm.LastInput(SharedInput, SharedInput.forward_done)
        self._ref_inputs = fastgemm.LastInput(dict)  # the reference path's: the input's casts and quantizations
        self.grouped_mode = grouped_experts.mode_from_env()  # routed experts as one grouped op (grouped_experts.py)
        self._grouped: dict = {}  # first expert's gate name -> its layer's runner (or None: the loop), per step
        missing = [n for n in model.linear_names() if n not in self.specs]
        if missing:
            raise KeyError(f"plan {plan.policy_name!r} has no entry for {missing[0]} (plan/model mismatch: was the "
                           f"plan resolved for {plan.model}?)")

    def install(self) -> "TrainerExecutor":
        self.model.linear_executor = self
        # non-GEMM params are BF16 in the checkpoint / rollout: round them (straight-through) in the trainer too
        self.model.hp_param = lambda p: p + (_bf16(p.detach()) - p.detach())
        return self

    @property
    def device(self) -> torch.device:
        return next(iter(self._params.values())).device

    @property
    def fast(self) -> bool:
        return self.gemm == "fast" or (self.gemm == "auto" and self.device.type == "cuda")

    @property
    def native(self) -> bool:
        """Native FP8 GEMMs for fp8_block linears: fast path on a device whose cuBLASLt has block scaling (asked once
        per device: every linear call reads it)."""
        dev = self.device
        if self._native is None or self._native[0] != dev:
            self._native = (dev, self.fast and fastgemm.native_fp8_available(dev))
        return self._native[1]

    def invalidate(self) -> None:
        self.quantized.clear()
        self._fwd.clear()
        self._inputs.clear()
        self._ref_inputs.clear()
        self._grouped.clear()

    def _shared_input(self, x: torch.Tensor, x2: torch.Tensor) -> SharedInput:
        """The SharedInput of `x` (x2: its [M, K] view): the last one if `x` is the last input seen, else a new one."""
        return self._inputs.get(x, x2)

    def _refresh(self) -> None:
        linear = {n: self._params[n] for n in self.specs}
        w16s: dict = {}
        fast = self.fast
        deq: Optional[dict] = None if fast else {}
        q = quantize_weights(self.plan, linear, w16s, deq)
        for n, v in q.items():
            if isinstance(v, torch.Tensor):
                self._fwd[n] = FastWeight(v, fastgemm.Op(v)) if fast else v.to(torch.float32)
            else:
                self.quantized[n] = v
                if fast:
                    self._fwd[n] = FastWeight(w16s[n], q=v)
                else:
                    self._fwd[n] = deq[n] if n in deq else numerics.dequantize(v, torch.float32)

    def _grouped_kind(self, spec: LinearSpec, fw) -> Optional[str]:
        if not isinstance(fw, FastWeight) or spec.act_partitions != 1:
            return None
        if _native_fp8(spec, self.native) and _native_fp8_grad(spec) and fw.q is not None:
            return "fp8"
        if spec.weight == BF16 and spec.activation == BF16 \
                and not (spec.backward == BackwardMode.QUANTIZED and spec.grad.is_quantized):
            return "bf16"
        return None

    def grouped_experts(self, trios: list, x: torch.Tensor) -> Optional[grouped_experts.TrainerExperts]:
        """One MoE layer's routed experts (gate, up, down names per expert) as one grouped op, when the fast path runs
        them all natively in FP8 or all in BF16 with one format per role (grouped_experts.py); None: the loop."""
        if not grouped_experts.wanted(self.grouped_mode, x) or not self.fast:
            return None
        if not self._fwd:
            self._refresh()
        key = trios[0][0]
        if key not in self._grouped:  # decided once per layer and step (the weights' FastWeights change per step)
            self._grouped[key] = self._grouped_runner(trios)
        return self._grouped[key]

    def _grouped_runner(self, trios: list) -> Optional[grouped_experts.TrainerExperts]:
        fws = [tuple(self._fwd[n] for n in trio) for trio in trios]
        specs = [tuple(self.specs[n] for n in trio) for trio in trios]
        kinds = {self._grouped_kind(s, f) for sf, ff in zip(specs, fws) for s, f in zip(sf, ff)}
        roles = [{(sf[i].activation, sf[i].grad) for sf in specs} for i in (0, 1, 2)]
        if len(kinds) != 1 or None in kinds or any(len(r) != 1 for r in roles) or roles[0] != roles[1]:
            return None
        params = [tuple(self._params[n] for n in trio) for trio in trios]
        return grouped_experts.TrainerExperts(self, kinds.pop(), fws, specs, params)

    def weight_col_op(self, spec: LinearSpec, fw: FastWeight) -> fastgemm.Op:
        """The weight's columnwise copy for a quantized dgrad (from BF16(master), fp32 in as the reference), once
        per step."""
        if fw.col_op is None:
            fw.col_op = _fake_op(fw.w16, spec.weight, axis="col", what=spec.hf_name) \
                if spec.weight.is_quantized else fastgemm.Op(fw.w16)
        return fw.col_op

    def forward_weight(self, hf_name: str) -> torch.Tensor:
        """The fp32 dequantized forward weight (reference semantics; on the fast path rebuilt from its operand)."""
        if not self._fwd:
            self._refresh()
        v = self._fwd[hf_name]
        return v.op.dense() if isinstance(v, FastWeight) else v

    def current_quantized(self) -> dict[str, object]:
        """The QuantizedTensors the forward uses for the current weights (computed now if stale)."""
        if not self._fwd:
            self._refresh()
        return self.quantized

    def gemm_report(self) -> dict:
        """GEMM calls per path so far (fastgemm.PATH_NOTES says what each path is)."""
        return dict(sorted(self.stats.counts.items()))

    def __call__(self, hf_name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self._fwd:
            self._refresh()
        spec = self.specs[hf_name]
        fw = self._fwd[hf_name]
        # 2*M*K*N per GEMM: forward, plus dgrad + wgrad when autograd will run the backward
        self.stats.flops += 2 * x.numel() * w.shape[0] * (3 if torch.is_grad_enabled() and w.requires_grad else 1)
        if not isinstance(fw, FastWeight):
            self.stats.add(fastgemm.FP32, 3 if torch.is_grad_enabled() and w.requires_grad else 1)
            return qlinear(x, w, fw, spec, self._ref_inputs.get(x))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xs = self._shared_input(x, x2)
        xs.backward = torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)
        y = FastQLinearFunction.apply(x2, w, fw, spec, self, xs)
        return y.reshape(*shape[:-1], w.shape[0])
