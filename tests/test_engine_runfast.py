"""The CPU speed-ups of `policyc run` compute exactly what they replace: the rollout's MoE layer with row-local
activations quantized once for all experts ("rows" runner) gives the per-expert loop's logits bit for bit, the
trainer's row-scaled NVFP4 weight stack gives every weight its own per-tensor bytes, and the reference linears that
share one input's quantization give the unshared forward and gradients bit for bit."""

import pytest
import torch

from precision_dsl.arch import load_architecture
from precision_dsl.engine import numerics, qlinear, rollout_gemm
from precision_dsl.engine.model import load_model, resolve_model_dir
from precision_dsl.engine.plans import load_plan
from precision_dsl.engine.weight_path import same_bytes

IDS = torch.randint(3, 32, (6, 21), generator=torch.Generator().manual_seed(0))
NVFP4 = "nvfp4-pertoken-dequant-backward"


def _rollout(policy: str, mode: str):
    from precision_dsl.engine.rollout_gemm import IndependentRolloutExecutor

    plan = load_plan(policy, load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe"))
    weights = qlinear.quantize_weights(plan, {n: p for n, p in model.named_parameters() if n in plan.by_name()})
    rmodel = load_model(resolve_model_dir("tiny-moe")).to(dtype=torch.bfloat16)
    ex = IndependentRolloutExecutor(plan, rmodel.linear_names())
    ex.grouped_mode = mode
    for n in rmodel.linear_names():
        ex.load(n, weights[n], "cpu")
    rmodel.linear_executor = ex
    return rmodel, ex


@pytest.mark.parametrize("policy", [NVFP4, "mxfp8-e2e", "fp8-blockwise-hopper", "bf16"])
@pytest.mark.parametrize("ids", [IDS, IDS[:1, :1]], ids=["batch", "one-token"])
def test_rollout_rows_runner_equals_the_loop(policy, ids):
    loop, lex = _rollout(policy, "off")
    rows, rex = _rollout(policy, "auto")
    with torch.no_grad():
        ref, got = loop(ids), rows(ids)
    kinds = {r.kind for r in rex._grouped.values() if r is not None}
    assert kinds == {"rows"} and not lex._grouped
    assert torch.equal(ref, got)
    assert lex.paths == rex.paths  # the same GEMMs on the same paths


def test_rows_runner_needs_row_local_formats():
    from precision_dsl.precision import Scope

    plan = load_plan(NVFP4, load_architecture("tiny-moe"))
    act = next(t.precision.activation for t in plan.tensors if t.role == "routed_experts.up")
    assert rollout_gemm.row_local(act)
    per_tensor = act.model_copy(update={"global_scale": Scope.TENSOR})
    assert not rollout_gemm.row_local(per_tensor)  # one scale over all rows: each expert's rows differ
    _, ex = _rollout(NVFP4, "auto")
    trios = load_model(resolve_model_dir("tiny-moe")).model.layers[0].mlp.trios
    assert ex.grouped_experts(trios, torch.zeros(4, 128, dtype=torch.bfloat16)).kind == "rows"
    for trio in trios:
        ex.act[trio[2]] = per_tensor
    ex._grouped.clear()
    assert ex.grouped_experts(trios, torch.zeros(4, 128, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("policy", [NVFP4, "nvfp4-weight-only", "miles-nvfp4", "language-tour"])
def test_row_scaled_weight_stack_is_each_weights_own_quantization(policy):
    plan = load_plan(policy, load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe"))
    w = {n: p for n, p in model.named_parameters() if n in plan.by_name()}
    deq: dict = {}
    q = qlinear.quantize_weights(plan, w, None, deq)
    by, amax = plan.by_name(), qlinear.group_amaxes(plan, w)
    assert deq  # the stack ran
    for name, v in q.items():
        if isinstance(v, torch.Tensor):
            continue
        tp = by[name]
        fmt = tp.precision.weight
        ga = amax.get(tp.share_scale_group) if fmt.spec.takes_global_amax else None
        ref = numerics.quantize(w[name].detach().to(torch.bfloat16), fmt, global_amax=ga)
        a, b = v.tensors(), ref.tensors()
        assert (v.fmt, v.shape, v.axis, a.keys()) == (ref.fmt, ref.shape, ref.axis, b.keys()), name
        assert all(same_bytes(a[k], b[k]) for k in a), name
        if name in deq:
            assert torch.equal(deq[name], numerics.dequantize(ref, torch.float32)), name


def test_row_scaled_stack_leaves_non_finite_weights_to_the_per_tensor_path():
    plan = load_plan(NVFP4, load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe"))
    w = {n: p.detach().clone() for n, p in model.named_parameters() if n in plan.by_name()}
    bad = next(n for n, t in plan.by_name().items() if t.role == "routed_experts.down")
    w[bad][0, 0] = float("nan")
    deq: dict = {}
    q = qlinear.quantize_weights(plan, w, None, deq)
    downs = [n for n, t in plan.by_name().items() if t.role == "routed_experts.down"]
    assert deq and not set(downs) & set(deq)  # the stack of that format fell back: each down on its own
    ref = numerics.quantize(w[bad].to(torch.bfloat16), plan.by_name()[bad].precision.weight)
    assert same_bytes(q[bad].data, ref.data)


def _trainer_grads(share: bool):
    from precision_dsl.engine.qlinear import TrainerExecutor

    plan = load_plan(NVFP4, load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe")).train()
    ex = TrainerExecutor(plan, model).install()
    if not share:  # every linear derives its input's operands itself
        ex._ref_inputs.get = lambda x: None
    logits = model(IDS)
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_shared_reference_inputs_give_the_same_forward_and_gradients():
    l0, g0 = _trainer_grads(False)
    l1, g1 = _trainer_grads(True)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_reference_forward_without_backward_is_the_functions_forward():
    from precision_dsl.engine.qlinear import linear_specs

    plan = load_plan(NVFP4, load_architecture("tiny-moe"))
    spec = next(s for n, s in linear_specs(plan).items() if s.activation.is_quantized and "down_proj" in n)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 128, generator=g), torch.randn(128, 128, generator=g)
    w_fwd = numerics.fake_quantize(w.to(torch.bfloat16), spec.weight)
    with torch.no_grad():
        y0 = qlinear.qlinear(x, w, w_fwd, spec)
    y1 = qlinear.qlinear(x, w.requires_grad_(), w_fwd, spec)
    assert y1.requires_grad and torch.equal(y0, y1.detach())
