"""The routed experts of a layer as one grouped op (engine/grouped_experts.py) against the per-expert loop: same
dispatch, same operand bytes, same forward and gradients; on the H200 natively."""

import pytest
import torch

from precision_dsl.engine import fastgemm, grouped_experts, rollout_gemm
from precision_dsl.engine.qlinear import TrainerExecutor

from test_engine_fastgemm import _fake_scaled_mm, _need_sm90, _rel

IDS = torch.randint(3, 32, (6, 21), generator=torch.Generator().manual_seed(0))


def _topi(t=300, e=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


@pytest.mark.parametrize("align", [1, 16, 128])
def test_dispatch_places_each_experts_tokens_in_its_aligned_segment(align):
    topi = _topi()
    # expert 5 gets no token (a zero-length segment): its slots move to an expert the token does not have yet
    free = [torch.tensor([e for e in range(8) if e != 5 and e not in row]) for row in topi.tolist()]
    topi = torch.stack([torch.where(row == 5, f[0], row) for row, f in zip(topi, free)])
    flat = torch.randn(300, 24)
    d = grouped_experts.dispatch(topi, 8, align)
    x = grouped_experts.gather(flat, 2, d)
    segs = d.segments()
    counts = torch.bincount(topi.reshape(-1), minlength=8).tolist()
    assert [n for _, n, _ in segs] == counts and counts[5] == 0
    for e, (s, n, r) in enumerate(segs):
        assert s % align == 0 and r == -(-n // align) * align and s + r <= d.rows
        rows = (topi == e).nonzero()[:, 0]  # the loop's rows of expert e, in its order
        assert torch.equal(x[s:s + n], flat[rows])
        assert not x[s + n:s + r].any()  # zero pad rows
    assert d.used_rows <= d.rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_is_the_loops_index_add_sequence_bitwise(dtype):
    topi = _topi(k=4, seed=1)
    t = topi.shape[0]
    topw = torch.rand(t, 4).to(dtype)
    d = grouped_experts.dispatch(topi, 8, 16)
    y = torch.randn(d.rows, 40).to(dtype)
    want = torch.zeros(t, 40)
    for e, (s, n, _) in enumerate(d.segments()):
        tok, slot = (topi == e).nonzero(as_tuple=True)
        want.index_add_(0, tok, (y[s:s + n] * topw[tok, slot, None]).float())
    assert torch.equal(grouped_experts.combine(y, topw, d), want)


def test_grouped_columnwise_copy_is_each_experts_own():
    """With 128-aligned segments, one columnwise 1x128 quantization of the grouped buffer holds, for each expert, the
    bytes and scales of that expert's rows quantized alone (zero-padded to whole 128-token blocks)."""
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.plans import load_plan

    fmt = next(t.precision.activation for t in load_plan("fp8-blockwise-hopper", load_architecture("tiny-moe")).tensors
               if t.hf_name.endswith("experts.0.down_proj.weight"))
    topi = _topi(t=700, seed=2)
    flat = torch.randn(700, 256) * torch.logspace(-3, 3, 700)[:, None]
    d = grouped_experts.dispatch(topi, 8, 128)
    x16 = grouped_experts.gather(flat, 2, d).to(torch.bfloat16)
    _, data, scale, q_col = fastgemm.fp8_rowcol16(x16, fmt)
    for e, (s, n, r) in enumerate(d.segments()):
        rows = (topi == e).nonzero()[:, 0]
        qr, rd, rs, qc = fastgemm.fp8_rowcol16(flat[rows].to(torch.bfloat16), fmt)
        assert torch.equal(data[s:s + n], qr.data) and torch.equal(scale[s:s + n], qr.scale)
        assert torch.equal(q_col.data[:, s:s + r], qc.data) and torch.equal(q_col.scale[:, s // 128:(s + r) // 128],
                                                                             qc.scale)


def _trainer(policy, mode, device="cpu", ids=IDS):
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    model = load_model(resolve_model_dir("tiny-moe")).to(device)
    ex = TrainerExecutor(load_plan(policy, load_architecture("tiny-moe")), model, gemm="fast")
    ex.grouped_mode = mode
    ex.install()
    logits = model(ids.to(device))
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ex


def _count_grouped(monkeypatch):
    runs = []
    real = grouped_experts.GroupedExpertsFunction.forward

    def counted(ctx, x, run, d, *p):
        runs.append(run.kind)
        return real(ctx, x, run, d, *p)
    monkeypatch.setattr(grouped_experts.GroupedExpertsFunction, "forward", staticmethod(counted))
    return runs


@pytest.mark.parametrize("policy,native", [("bf16", False), ("fp8-blockwise-hopper", True),
                                           ("fp8-blockwise-hopper", False)])
def test_trainer_grouped_experts_equal_the_loop_on_cpu(monkeypatch, policy, native):
    """tiny-moe, forward + backward: the grouped experts give the loop's logits and every gradient (fp32 GEMMs on
    CPU; native FP8's plumbing through torch._scaled_mm's contract spelled out, _fake_scaled_mm). Policies the
    grouped op does not take (fp8 without native FP8, emulated formats) keep the loop."""
    if native:
        monkeypatch.setattr(fastgemm, "native_fp8_available", lambda device: True)
        monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm, raising=False)
    runs = _count_grouped(monkeypatch)
    l0, g0, ex0 = _trainer(policy, "off")
    assert not runs
    l1, g1, ex1 = _trainer(policy, "on")
    if policy == "bf16" or native:
        assert len(runs) == 4, runs
    else:  # emulated fp8 keeps the loop; the policy's one BF16 MoE layer is grouped
        assert runs == ["bf16"], runs
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), (n, _rel(g1[n], g0[n]))
    if native:
        p0, p1 = ex0.gemm_report(), ex1.gemm_report()
        assert p1.get("fp8-fallback-emulated", 0) == p0.get("fp8-fallback-emulated", 0), (p0, p1)
    assert ex0.stats.flops == ex1.stats.flops


def test_trainer_grouped_experts_under_no_grad(monkeypatch):
    monkeypatch.setattr(fastgemm, "native_fp8_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm, raising=False)
    runs = _count_grouped(monkeypatch)
    out = []
    for mode in ("off", "on"):
        from precision_dsl.arch import load_architecture
        from precision_dsl.engine.model import load_model, resolve_model_dir
        from precision_dsl.engine.plans import load_plan

        model = load_model(resolve_model_dir("tiny-moe"))
        ex = TrainerExecutor(load_plan("fp8-blockwise-hopper", load_architecture("tiny-moe")), model, gemm="fast")
        ex.grouped_mode = mode
        ex.install()
        with torch.no_grad():
            out.append(model(IDS))
    assert runs and torch.equal(out[0], out[1])


def test_a_format_mix_keeps_the_loop(monkeypatch):
    """One expert whose down_proj differs from the others (here: BF16 in an FP8 layer) -> no grouped op for that
    layer, in the trainer and in the rollout; the mode is validated."""
    import dataclasses

    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan
    from precision_dsl.precision import BackwardMode, FormatKind, TensorFormat

    monkeypatch.setattr(fastgemm, "native_fp8_available", lambda device: True)
    plan = load_plan("fp8-blockwise-hopper", load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe"))
    ex = TrainerExecutor(plan, model, gemm="fast")
    ex.grouped_mode = "on"
    trios = model.model.layers[0].mlp.trios
    x = torch.zeros(4, 128)
    assert ex.grouped_experts(trios, x).kind == "fp8"
    bf16 = TensorFormat(kind=FormatKind.BF16, element="bf16")
    ex.specs[trios[3][2]] = dataclasses.replace(ex.specs[trios[3][2]], weight=bf16, activation=bf16, grad=bf16,
                                                backward=BackwardMode.HIGH_PRECISION)
    ex.invalidate()
    assert ex.grouped_experts(trios, x) is None
    ex.grouped_mode = "off"
    ex.invalidate()
    assert ex.grouped_experts(trios, x) is None
    _, rex = _rollout_logits("fp8-blockwise-hopper", "on")
    assert rex.grouped_experts(trios, x).kind == "fp8"
    rex.act[trios[5][0]] = bf16
    rex._grouped.clear()
    assert rex.grouped_experts(trios, x) is None
    monkeypatch.setenv("POLICYC_GROUPED_EXPERTS", "sometimes")
    with pytest.raises(ValueError, match="POLICYC_GROUPED_EXPERTS"):
        grouped_experts.mode_from_env()


def _rollout_logits(policy, mode, device="cpu"):
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan
    from precision_dsl.engine.rollout_gemm import IndependentRolloutExecutor
    from precision_dsl.engine.qlinear import quantize_weights

    plan = load_plan(policy, load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe")).to(device)
    weights = quantize_weights(plan, {n: p for n, p in model.named_parameters() if n in plan.by_name()})
    rmodel = load_model(resolve_model_dir("tiny-moe")).to(device=device, dtype=torch.bfloat16)
    ex = IndependentRolloutExecutor(plan, rmodel.linear_names())
    ex.grouped_mode = mode
    for n in rmodel.linear_names():
        ex.load(n, weights[n], device)
    rmodel.linear_executor = ex
    with torch.no_grad():
        return rmodel(IDS.to(device)), ex


@pytest.mark.parametrize("policy", ["bf16", "fp8-blockwise-hopper"])
def test_rollout_grouped_experts_equal_the_loop_on_cpu(monkeypatch, policy):
    """The independent rollout's experts, grouped: the loop's logits bit for bit (bf16 model, fp8 emulated on CPU)."""
    runs = []
    real = rollout_gemm.RolloutExperts.__call__
    monkeypatch.setattr(rollout_gemm.RolloutExperts, "__call__",
                        lambda self, x, d: runs.append(self.kind) or real(self, x, d))
    l0, _ = _rollout_logits(policy, "off")
    assert not runs
    l1, _ = _rollout_logits(policy, "on")
    assert len(runs) == 4
    assert torch.equal(l0, l1), _rel(l1.float(), l0.float())


# ---------------------------------------------------------------------------------------------------------------
# H200
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["bf16", "fp8-blockwise-hopper"])
def test_grouped_experts_on_gpu_equal_the_loop(monkeypatch, policy):
    """On the H200: the trainer's grouped experts (native FP8 GEMMs on slices of the grouped buffers, written in
    place) against the loop, and the rollout's; the experts' FP8 GEMMs all native (the only emulated GEMMs are the
    loop's too: tiny-moe's k/v dgrad, contraction 64 < 128); the dispatch never waits for the GPU."""
    _need_sm90()
    topi = _topi().cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the dispatch or the gather raises
    try:
        d = grouped_experts.dispatch(topi, 8, 128)
        grouped_experts.gather(torch.randn(300, 64, device="cuda"), 2, d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [n for _, n, _ in d.segments()] == torch.bincount(topi.reshape(-1).cpu(), minlength=8).tolist()
    runs = _count_grouped(monkeypatch)
    l0, g0, ex0 = _trainer(policy, "off", "cuda")
    l1, g1, ex1 = _trainer(policy, "on", "cuda")
    assert len(runs) == 4 and g0.keys() == g1.keys()
    p1 = ex1.gemm_report()
    print(policy, "grouped trainer GEMMs:", p1, "loop:", ex0.gemm_report(), ex1.fp8.errors)
    if policy != "bf16":
        assert "fp8-fallback-emulated" not in p1 or p1["fp8-fallback-emulated"] == \
            ex0.gemm_report().get("fp8-fallback-emulated"), (p1, ex1.fp8.errors)
    assert _rel(l1.float(), l0.float()) < 1e-5, _rel(l1.float(), l0.float())
    for n in g0:
        assert _rel(g1[n], g0[n]) < 1e-4 if g0[n].norm() > 0 else torch.equal(g1[n], g0[n]), (n, _rel(g1[n], g0[n]))
    rruns = []
    real = rollout_gemm.RolloutExperts.__call__
    monkeypatch.setattr(rollout_gemm.RolloutExperts, "__call__",
                        lambda self, x, d: rruns.append(self.kind) or real(self, x, d))
    r0, rex0 = _rollout_logits(policy, "off", "cuda")
    assert not rruns
    r1, rex1 = _rollout_logits(policy, "on", "cuda")
    assert len(rruns) == 4, rruns
    print(policy, "rollout paths grouped:", rex1.paths, "loop:", rex0.paths)
    assert "fp8-blocked-emulated" not in rex1.paths or policy == "bf16", rex1.paths
    assert _rel(r1.float(), r0.float()) < 1e-3, _rel(r1.float(), r0.float())
