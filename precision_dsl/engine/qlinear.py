"""Plan-driven quantized linears for the trainer (emulated: quantize -> dequantize -> FP32 GEMM).

For every GEMM weight the plan's `TensorPlan.precision` gives the weight / activation / gradient formats and the
backward mode. `QLinearFunction` implements the forward and the three backward rules of TransformerEngine's
`NVTE_BACKWARD_OVERRIDE` (TE PR #2644, see ../shared/research/miles.md section 5):

  forward          y  = Q_a(x) @ Q_w(W)^T                   (Q = fake quantization in the plan's format)
  high_precision   dx = g @ W_bf16,         dW = g^T @ x_bf16         (backward on the ORIGINAL BF16 operands)
  dequantized      dx = g @ Q_w(W),         dW = g^T @ Q_a(x)         (backward on the forward's dequantized operands)
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

from ..plan import Plan
from ..precision import QUANTIZED_BACKWARD_KINDS, BackwardMode, FormatKind, TensorFormat
from . import numerics

BF16_FMT = TensorFormat(kind=FormatKind.BF16, element="bf16")


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
        if p.backward == BackwardMode.QUANTIZED and p.grad.is_quantized and p.grad.kind not in QUANTIZED_BACKWARD_KINDS:
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
def quantize_weights(plan: Plan, weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """hf_name -> QuantizedTensor (quantized linears) or a BF16 tensor (everything else), from BF16(master).
    This is the trainer's forward weight; the weight-update sender must produce the same bytes."""
    by_name = plan.by_name()
    amax = group_amaxes(plan, weights)
    out: dict[str, object] = {}
    for name, w in weights.items():
        tp = by_name.get(name)
        if tp is None:
            raise KeyError(f"{name}: tensor is not in the plan (plan for {plan.model})")
        fmt = tp.precision.weight
        w16 = w.detach().to(torch.bfloat16)
        if tp.is_linear and fmt.is_quantized:
            ga = amax.get(tp.share_scale_group) if fmt.kind == FormatKind.NVFP4 else None
            out[name] = numerics.quantize(w16, fmt, global_amax=ga, what=name)
        else:
            out[name] = w16.clone()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the autograd function
# ---------------------------------------------------------------------------------------------------------------
class QLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, w: torch.Tensor, w_fwd: torch.Tensor, spec: LinearSpec):
        """x2 [M, K] fp32, w [N, K] master (fp32), w_fwd [N, K] = the dequantized forward weight (no grad)."""
        x_hp = _bf16(x2)  # the original BF16 operand (activations are BF16 in the trainer)
        x_q = numerics.fake_quantize_partitioned(x_hp, spec.activation, spec.act_partitions, what=spec.hf_name)
        y = x_q @ w_fwd.t()
        ctx.spec = spec
        if spec.backward == BackwardMode.DEQUANTIZED:
            ctx.save_for_backward(x_q, w_fwd)
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
            g_row = numerics.fake_quantize(g, spec.grad, axis="row", what=spec.hf_name + " dgrad")
            w_col = numerics.fake_quantize(b, spec.weight, axis="col", what=spec.hf_name) \
                if spec.weight.is_quantized else b
            dx = g_row @ w_col
            # wgrad: contraction over M (tokens) -> columnwise copies of g and x (blocks along M)
            g_col = numerics.fake_quantize(g, spec.grad, axis="col", what=spec.hf_name + " wgrad")
            x_col = numerics.fake_quantize(a, spec.activation, axis="col", what=spec.hf_name) \
                if spec.activation.is_quantized else a
            dw = g_col.t() @ x_col
        else:
            dx = g @ b
            dw = g.t() @ a
        return dx, dw, None, None


def qlinear(x: torch.Tensor, w: torch.Tensor, w_fwd: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    shape = x.shape
    y = QLinearFunction.apply(x.reshape(-1, shape[-1]), w, w_fwd, spec)
    return y.reshape(*shape[:-1], w.shape[0])


# ---------------------------------------------------------------------------------------------------------------
# executor installed on the trainer model
# ---------------------------------------------------------------------------------------------------------------
class TrainerExecutor:
    """The trainer's linear executor: plan-driven QLinearFunction with per-step cached weight quantization.
    Call `invalidate()` after every optimizer step (the loop does)."""

    def __init__(self, plan: Plan, model, etp: int = 1):
        self.plan = plan
        self.specs = linear_specs(plan, etp)
        self.model = model
        self._params = dict(model.named_parameters())
        self.quantized: dict[str, object] = {}  # hf_name -> QuantizedTensor of the current step (for checks)
        self._fwd: dict[str, torch.Tensor] = {}
        missing = [n for n in model.linear_names() if n not in self.specs]
        if missing:
            raise KeyError(f"plan {plan.policy_name!r} has no entry for {missing[0]} (plan/model mismatch: was the "
                           f"plan resolved for {plan.model}?)")

    def install(self) -> "TrainerExecutor":
        self.model.linear_executor = self
        # non-GEMM params are BF16 in the checkpoint / rollout: round them (straight-through) in the trainer too
        self.model.hp_param = lambda p: p + (_bf16(p.detach()) - p.detach())
        return self

    def invalidate(self) -> None:
        self.quantized.clear()
        self._fwd.clear()

    def _refresh(self) -> None:
        linear = {n: self._params[n] for n in self.specs}
        q = quantize_weights(self.plan, linear)
        for n, v in q.items():
            if isinstance(v, torch.Tensor):
                self._fwd[n] = v.to(torch.float32)
            else:
                self.quantized[n] = v
                self._fwd[n] = numerics.dequantize(v, torch.float32)

    def forward_weight(self, hf_name: str) -> torch.Tensor:
        if not self._fwd:
            self._refresh()
        return self._fwd[hf_name]

    def current_quantized(self) -> dict[str, object]:
        """The QuantizedTensors the forward uses for the current weights (computed now if stale)."""
        if not self._fwd:
            self._refresh()
        return self.quantized

    def __call__(self, hf_name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return qlinear(x, w, self.forward_weight(hf_name), self.specs[hf_name])
