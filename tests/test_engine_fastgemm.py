"""engine/fastgemm.py + the fast QLinear path: operands bit for bit the reference's, results the reference GEMM's
(up to accumulation order), native FP8 on the H200 with our quantizers' bytes, emulation fallback on CPU."""

from __future__ import annotations

import pytest
import torch

from precision_dsl import formats
from precision_dsl.engine import fastgemm, numerics
from precision_dsl.engine.qlinear import LinearSpec, TrainerExecutor, _fake_op
from precision_dsl.precision import BackwardMode, FormatKind, TensorFormat

BF16 = TensorFormat(kind=FormatKind.BF16, element="bf16")
MX = TensorFormat(kind=FormatKind.MXFP8, element="e4m3", block=(1, 32), scale_dtype="e8m0")
MX5 = TensorFormat(kind=FormatKind.MXFP8, element="e5m2", block=(1, 32), scale_dtype="e8m0")
NV_ROW = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row")
NV_T = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="tensor")
FB_A = TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype="fp32")
FB_W = TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(128, 128), scale_dtype="fp32")
FB_P = TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype="pow2")


def _x(m=40, k=256, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:  # per-row magnitudes over ~20 binades: exercises scales far from 1
        x = x * torch.exp2(torch.randint(-12, 8, (m, 1), generator=g).float())
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("fmt,axis", [(MX, "row"), (MX, "col"), (MX5, "row"), (MX5, "col"), (NV_ROW, "row"),
                                      (NV_T, "row"), (FB_A, "row"), (FB_A, "col"), (FB_P, "row"), (FB_W, "row")])
def test_fake_op_dense_is_bitwise_the_reference_fake_quant(fmt, axis):
    x = _x(m=256 if fmt == FB_W else 40)
    op = _fake_op(x, fmt, axis=axis)
    ref = numerics.fake_quantize(x, fmt, axis=axis)
    assert op.dense().shape == ref.shape
    assert torch.equal(op.dense().view(torch.int32), ref.view(torch.int32))  # bitwise, incl. -0.0
    if fmt.kind in (FormatKind.MXFP8, FormatKind.NVFP4) or fmt.scale_dtype == "pow2":
        assert op.exact and op.v.dtype == torch.bfloat16  # elements exact in bf16: tensor-core operand
    else:
        assert not op.exact  # fp32 scale_inv x element is not bf16-exact: kept in fp32
    if fmt == NV_ROW:
        assert op.s.shape == (40,)  # the per-token S_dec goes to the epilogue, not into the bf16 operand


@pytest.mark.parametrize("fmt", [MX, NV_ROW, NV_T, FB_A])
def test_bf16_dequantized_is_te_dequantize_to_bf16(fmt):
    """A dequantized backward's operand = the fp32 dequantized value rounded once to bf16 (TE 2.20.2
    `dequantize(dtype=bf16)`), bitwise; a bf16-exact operand without a second-level scale (MXFP8) comes back as is."""
    x = _x()
    op = _fake_op(x, fmt)
    b = fastgemm.bf16_dequantized(op)
    ref = numerics.fake_quantize(x, fmt).to(torch.bfloat16)
    assert b.s is None and b.exact and b.v.dtype == torch.bfloat16
    assert torch.equal(b.v.view(torch.int16), ref.view(torch.int16))
    if fmt == MX:
        assert b is op
    else:  # fp32 second-level scales: the rounding is real
        assert not torch.equal(b.v.float(), op.dense())


@pytest.mark.parametrize("fmt", [MX, MX5, NV_ROW, NV_T])
def test_mxfp8_nvfp4_bytes_do_not_depend_on_the_input_dtype(fmt):
    """The fast path quantizes the bf16 operand itself (no fp32 copy): the MXFP8/NVFP4 references compute on the
    fp32 values with dtype-independent constants, so the bytes equal those of the fp32 copy the reference path
    quantizes (FP8 block scaling is NOT dtype-free: it clamps an overflowing scale to the input dtype's max)."""
    x16 = _x().to(torch.bfloat16)
    x16[7, :64] = 1e-38  # tiny blocks: where a dtype-dependent clamp would show
    a, b = formats.quantize(x16, fmt), formats.quantize(x16.float(), fmt)
    assert all(torch.equal(u, v) for u, v in zip(a.tensors().values(), b.tensors().values()))


def test_trainer_quantizes_the_bf16_tensor_like_te_and_the_rollout():
    """FP8 block scaling clamps an overflowing scale (block amax < 448 / FLT_MAX ~ 1.3e-36) to the INPUT dtype's
    max: the trainer hands its BF16 operands to the quantizers as bf16 tensors (TE's in_dtype, and what the rollout
    quantizes), so such a block gets bf16's clamp, not fp32's."""
    x16 = _x(4, 256).to(torch.bfloat16)
    x16[1, :128] = 1e-37  # amax below 448 / FLT_MAX
    got = numerics.fake_quantize(x16, FB_A)
    assert torch.equal(got, formats.fake_quantize(x16, FB_A, out_dtype=torch.float32))
    assert not torch.equal(got, formats.fake_quantize(x16.float(), FB_A, out_dtype=torch.float32))


def test_decode_kernels_interpreted():
    """kernels/triton_decode.py under TRITON_INTERPRET=1 (fresh process): MXFP8 bytes + E8M0 -> bf16 and NVFP4
    codes + E4M3 scales -> bf16 (times S_dec) equal the reference dequantization bitwise (e4m3/e5m2, rowwise and
    columnwise, zeros and -0.0, extreme block scales)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("decode_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 6 and all(r["same"] for r in rows), rows


def test_split3_is_exact_and_mm_matches_fp32_gemm():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 96), generator=g).float())
    parts = [t.float() for t in fastgemm._split3(v)]
    assert torch.equal((parts[0] + parts[1]) + parts[2], v)
    # the terms keep the operand's layout, and stacking along the contraction keeps a column-major operand
    # column-major (its leading dimension stays aligned for cuBLAS whatever the token count)
    vt = v[:63].t()  # [96, 63] column-major, 63 "tokens"
    terms = fastgemm._split3(vt)
    assert all(t.stride() == vt.stride() for t in terms)
    stacked = fastgemm._cat_k(terms)
    assert stacked.shape == (96, 189) and stacked.stride() == (1, 96)
    assert torch.equal(stacked.float().view(96, 3, 63).sum(1), vt)  # hi + mid + lo per element (exact in fp32)
    row = fastgemm._cat_k([v, v])
    assert row.shape == (64, 192) and row.stride() == (192, 1)
    # transposed per-row scaled operand: the scale runs along the contraction -> folded into an fp32 operand
    a = fastgemm.Op(_x(32, 64).to(torch.bfloat16), torch.rand(32) + 0.5)
    assert not a.t().exact and torch.equal(a.t().v, a.dense().t())


def test_tensor_core_paths_equal_the_fp32_gemm(monkeypatch):
    """The CUDA branches of mm (bf16 x bf16 -> fp32; an fp32 operand as 3 stacked bf16 terms; epilogue scales),
    with the bf16-input / fp32-output GEMM stood in by its CPU equivalent (exact bf16 products, fp32 sums): the
    result equals the fp32 GEMM of the dense operands up to fp32 accumulation (compared in fp64)."""
    monkeypatch.setattr(fastgemm, "_mm_bf16_f32", lambda a16, b16: a16.float() @ b16.float().t())
    g = torch.Generator().manual_seed(3)
    a16 = fastgemm.Op(torch.randn(50, 96, generator=g).to(torch.bfloat16), torch.rand(50, generator=g) + 0.5)
    w32 = fastgemm.Op(torch.randn(70, 96, generator=g) * 1.37, None, False)  # not bf16-exact
    w16 = fastgemm.Op(torch.randn(70, 96, generator=g).to(torch.bfloat16), torch.tensor([0.37]))
    for a, b, path in ((a16, w16, "bf16-tc"), (a16, w32, "bf16x3"), (w32, a16, "bf16x3"),
                       (a16.t(), fastgemm.Op(torch.randn(33, 50, generator=g).to(torch.bfloat16)), "bf16x3")):
        y, p = fastgemm._mm_tc(a, b)
        assert p == path
        ref = a.dense().double() @ b.dense().double().t()
        got = y * (a.s.view(-1, 1) if a.s is not None and a.s.numel() > 1 else 1) \
            * (b.s if b.s is not None else 1)  # the epilogue mm applies after _mm_tc
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-6, path


def _reference_and_fast(policy):
    """tiny-moe, one batch, forward + backward under the reference emulation and under the fast path: per mode
    (logits, {param: grad}, executor)."""
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    plan = load_plan(policy, load_architecture("tiny-moe"))
    ids = torch.randint(3, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    out = []
    for mode in ("reference", "fast"):
        model = load_model(resolve_model_dir("tiny-moe"))
        ex = TrainerExecutor(plan, model, gemm=mode).install()
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    ex))
    return out


@pytest.mark.parametrize("policy", ["mxfp8-e2e", "mxfp8-dequant-backward", "nvfp4-pertoken-dequant-backward",
                                    "nvfp4-pertoken-hp-backward", "fp8-blockwise-hopper", "bf16"])
def test_fast_executor_matches_reference_on_cpu(policy):
    """Same plan, same weights, same batch: the fast path's forward and gradients equal the reference emulation's
    (bitwise where the operands need no epilogue scale; NVFP4 moves S_dec to the epilogue: one rounding apart). On
    CPU nothing runs natively: fp8_block is emulated (counted as fp32 GEMMs, never as native-fp8)."""
    (lr, gr, exr), (lf, gf, exf) = _reference_and_fast(policy)
    assert not exf.native and "native-fp8" not in exf.gemm_report()
    assert set(exf.gemm_report()) == {"fp32"}
    exact = not policy.startswith("nvfp4")
    if exact:
        assert torch.equal(lf, lr)
    else:
        assert torch.allclose(lf, lr, rtol=1e-5, atol=1e-6)
    for n in gr:
        if exact:
            assert torch.equal(gf[n], gr[n]), n
        else:  # S_dec applied after the sum instead of per element: rounding-level differences in y, which a
            # downstream quantizer can turn into one-step differences of a few elements
            assert _rel(gf[n], gr[n]) < 1e-3, (n, _rel(gf[n], gr[n]))
    assert exr.current_quantized().keys() == exf.current_quantized().keys()
    for n, q in exr.current_quantized().items():  # the weight bytes the rollout must match: unchanged
        qf = exf.current_quantized()[n]
        assert all(torch.equal(a, b) for a, b in zip(q.tensors().values(), qf.tensors().values())), n


@pytest.mark.parametrize("policy", ["fp8-blockwise-hopper", "mxfp8-e2e", "nvfp4-pertoken-dequant-backward"])
def test_linears_reading_one_input_quantize_it_once(monkeypatch, policy):
    """q/k/v read one tensor, an expert's gate/up read one tensor: its BF16 cast and quantizations are made once for
    all of them (qlinear.SharedInput), with the same forward and gradients, bit for bit, as one per linear."""
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine import qlinear
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    plan = load_plan(policy, load_architecture("tiny-moe"))
    ids = torch.randint(3, 32, (4, 24), generator=torch.Generator().manual_seed(0))
    calls = []
    real = numerics.quantize
    monkeypatch.setattr(numerics, "quantize", lambda x, fmt, **kw: calls.append(fmt) or real(x, fmt, **kw))
    out = {}
    for shared in (False, True):
        model = load_model(resolve_model_dir("tiny-moe"))
        ex = TrainerExecutor(plan, model, gemm="fast").install()
        ex.current_quantized()  # the weights' quantizations, not counted below
        if not shared:
            monkeypatch.setattr(ex, "_shared_input", lambda x, x2: qlinear.SharedInput(x2))
        calls.clear()
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        out[shared] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                       len(calls))
    (l0, g0, n0), (l1, g1, n1) = out[False], out[True]
    assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert 0 < n1 < n0, (n1, n0)  # fewer quantizer calls (activations) with the input shared


def _size_stride(t, dim, size, stride) -> bool:
    return t.size(dim) == size and (t.stride(dim) == stride or size == 1)


def _fake_scaled_mm(a8, b8, scale_a, scale_b, out_dtype, out=None):
    """torch._scaled_mm's blockwise contract spelled out on CPU, refusing (RuntimeError) what torch 2.11's checks
    refuse (aten ScaledBlas.cpp is_blockwise_{1x128,128x128}_scaling on a and on b.t() / scale_b.t()): A [M, C]
    row-major with 1x128 scales [M, C/128] outer-dim-major; B [C, N] column-major with 1x128 scales (as
    scale_b.t(): [N, C/128] outer-dim-major) or a 128x128 grid (as scale_b.t(): [N/128, L] with row stride L4)."""
    m, c = a8.shape
    n = b8.shape[1]
    l = -(-c // 128)
    l4 = (l + 3) // 4 * 4
    m4, n4 = -(-m // 4) * 4, -(-n // 4) * 4
    # A row-major and B column-major, each with a leading dimension >= its rows' length and a multiple of 16 (a row
    # or column slice of a larger buffer: cuBLASLt's lda / ldb)
    if not (a8.stride(1) == 1 and a8.stride(0) >= c and a8.stride(0) % 16 == 0 and b8.stride(0) == 1
            and b8.stride(1) >= c and b8.stride(1) % 16 == 0 and c % 16 == 0 and n % 16 == 0):
        raise RuntimeError("layout")
    if m % 4:  # the H200's torch 2.11 refused every layout tried for M % 4 != 0 (3033x2048x3072, 2026-12-01)
        raise RuntimeError("Invalid scaling configuration (M % 4)")
    # 1x128 scales: outer-dim-major with 16-byte aligned columns (stride roundup(M, 4)): what the H200's torch 2.11
    # accepted (M % 4 == 0 always, M % 4 != 0 never with the plain layout)
    if not (_size_stride(scale_a, 0, m, 1) and _size_stride(scale_a, 1, l, m4)):
        raise RuntimeError("Invalid scaling configuration (a)")
    sbt = scale_b.t()
    if _size_stride(sbt, 0, n, 1) and _size_stride(sbt, 1, l, n4):  # 1x128 blocks along C
        b = b8.float() * sbt.t().repeat_interleave(128, 0)[:c]
    elif _size_stride(sbt, 0, -(-n // 128), l4) and _size_stride(sbt, 1, l, 1):  # 128x128 grid
        b = b8.float() * sbt.t().repeat_interleave(128, 0)[:c].repeat_interleave(128, 1)[:, :n]
    else:
        raise RuntimeError("Invalid scaling configuration (b)")
    a = a8.float() * scale_a.repeat_interleave(128, 1)[:, :c]
    y = (a @ b).to(out_dtype)
    return y if out is None else out.copy_(y)


@pytest.mark.parametrize("policy", ["fp8-blockwise-hopper"])
def test_native_fp8_plumbing_on_cpu(monkeypatch, policy):
    """The native FP8 path's plumbing (operands, transposes, scale layouts of forward / dgrad / wgrad, padding of
    the token dim) with torch._scaled_mm replaced by its contract spelled out (_fake_scaled_mm): forward and
    gradients equal the reference emulation's up to fp32 accumulation, and every GEMM is reported native - also
    the experts' GEMMs over token counts that are not a multiple of 4 (padded with zero rows)."""
    monkeypatch.setattr(fastgemm, "native_fp8_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm, raising=False)
    (lr, gr, _), (lf, gf, exf) = _reference_and_fast(policy)  # a fresh executor: its own NativeFp8Gemm state
    paths = exf.gemm_report()
    assert exf.native and paths.get("native-fp8", 0) > 0, paths
    # tiny-moe's k_proj/v_proj have N = 64 outputs: their dgrad contracts over 64 < 128 (not a whole FP8 block
    # for cuBLASLt) -> emulated, and reported as such: 3 fp8 layers x 2 projections
    assert paths.get("fp8-fallback-emulated") == 6, paths
    assert _rel(lf, lr) < 1e-5
    for n in gr:
        assert _rel(gf[n], gr[n]) < 1e-4 if gr[n].norm() > 0 else torch.equal(gf[n], gr[n]), n


def test_native_fp8_backward_reads_the_forwards_columnwise_copy_of_x(monkeypatch):
    """With a backward to come, each FP8 input's columnwise 1x128 copy is made in the forward, from the same read as
    its rowwise one (fastgemm.fp8_rowcol16), and the backward's wgrad reads it instead of quantizing x again; under
    no_grad the forward makes the rowwise copy only."""
    from precision_dsl import kernels
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine import qlinear
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    monkeypatch.setattr(fastgemm, "native_fp8_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm, raising=False)
    calls = {"rowcol": 0, "rows": 0, "col_quantize": 0}
    for name, key in (("fp8_rowcol16", "rowcol"), ("fp8_rows16", "rows")):
        real = getattr(fastgemm, name)
        monkeypatch.setattr(fastgemm, name, lambda *a, _r=real, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1)
                            or _r(*a, **k))
    real_q = kernels.fp8_block_quantize

    def counted(x, *a, **k):
        calls["col_quantize"] += k.get("axis") == "col"
        return real_q(x, *a, **k)
    monkeypatch.setattr(qlinear.kernels, "fp8_block_quantize", counted)
    model = load_model(resolve_model_dir("tiny-moe"))
    TrainerExecutor(load_plan("fp8-blockwise-hopper", load_architecture("tiny-moe")), model, gemm="fast").install()
    ids = torch.randint(3, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    model(ids).float().pow(2).mean().backward()
    # x operands (q/k/v share one, o, each expert's gate/up share one, down) + g operands: all row+col launches
    assert calls["rowcol"] > 0 and calls["rows"] == 0 and calls["col_quantize"] == 0, calls
    for k in calls:
        calls[k] = 0
    with torch.no_grad():
        model(ids)
    assert calls["rows"] > 0 and calls["rowcol"] == 0 and calls["col_quantize"] == 0, calls


def test_gemm_mode_is_validated():
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    plan = load_plan("bf16", load_architecture("tiny-moe"))
    with pytest.raises(ValueError, match="gemm must be one of"):
        TrainerExecutor(plan, load_model(resolve_model_dir("tiny-moe")), gemm="fastest")


# ---------------------------------------------------------------------------------------------------------------
# H200: native FP8 blockwise GEMMs
# ---------------------------------------------------------------------------------------------------------------
def _need_sm90():
    if not torch.cuda.is_available() or not fastgemm.native_fp8_available(torch.device("cuda", 0)):
        pytest.skip("needs an sm_90 GPU (cuBLASLt FP8 block scaling)")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
def test_decode_kernels_on_gpu():
    """The fast path's operands on the H200: quantize kernel + one-pass decode kernel == the CPU reference fake
    quantization, bitwise (MXFP8 rowwise and columnwise with a partial 32-row block, NVFP4 per token / tensor)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = _x(4100, 512)
    x[7, :16] = -1e-3  # rounds to -0.0 next to a large element
    x[7, 16] = 1e4
    x = x.to(torch.bfloat16).float()  # the fast path quantizes the bf16 operand: give the reference the same values
    for fmt in (MX, MX5, NV_ROW, NV_T):
        for axis in (("row", "col") if fmt.kind == FormatKind.MXFP8 else ("row",)):
            got = _fake_op(x.cuda().to(torch.bfloat16), fmt, axis=axis).dense().cpu()
            want = numerics.fake_quantize(x, fmt, axis=axis)
            bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
            assert len(bad) == 0, (fmt.short(), axis, len(bad), [(tuple(i.tolist()), float(x[tuple(i)]),
                                                                  float(got[tuple(i)]), float(want[tuple(i)]))
                                                                 for i in bad[:4]])


@pytest.mark.gpu
def test_native_fp8_gemms_use_reference_bytes_and_match_fp32_of_dequantized():
    """Forward (1x128 x 128x128), dgrad (1x128 x W columnwise 128x128) and wgrad (1x128 x 1x128 along tokens):
    operands byte-identical to the reference quantizers (formats/fp8_block.py), result within the accumulation
    tolerance of the fp32 GEMM of the dequantized operands. Shapes with K/128 and N/128 multiples of 4 (what the
    benchmark models have); other block counts are emulated when torch refuses them (reported in `errors`)."""
    _need_sm90()
    dev = "cuda"
    m, k, n = 300, 1024, 512
    x = _x(m, k).to(dev)
    w = (_x(n, k, seed=2, spread=False) * 0.02).to(torch.bfloat16).to(dev)
    g = _x(m, n, seed=3).to(dev)
    qx = numerics.quantize(x, FB_A)
    qw = numerics.quantize(w, FB_W)
    for q, src in ((qx, x), (qw, w)):
        ref = formats.quantize(src.cpu(), q.fmt)
        assert torch.equal(q.data.cpu(), ref.data) and torch.equal(q.scale.cpu(), ref.scale)
    stats = fastgemm.GemmStats()
    fp8 = fastgemm.NativeFp8Gemm()
    y = fp8(qx.data, qx.scale, (1, 128), qw.data, qw.scale, (128, 128), stats=stats)
    want = formats.dequantize(qx) @ formats.dequantize(qw).t()
    assert y is not None and _rel(y, want) < 5e-3, fp8.errors
    # dgrad: g rowwise (1x128 along N) x W's columnwise copy ([K, N] bytes, 128x128 tiles)
    qg = numerics.quantize(g, FB_A)
    wc = numerics.quantize(w.float(), FB_W, axis="col")
    ref = formats.quantize(w.float().cpu(), FB_W, axis="col")
    assert torch.equal(wc.data.cpu(), ref.data) and torch.equal(wc.scale.cpu(), ref.scale)
    dx = fp8(qg.data, qg.scale, (1, 128), wc.data, wc.scale, (128, 128), stats=stats)
    assert dx is not None and _rel(dx, formats.dequantize(qg) @ formats.dequantize(wc)) < 5e-3, fp8.errors
    # wgrad: columnwise copies of g and x along the (zero-padded) token dim
    gp, _ = numerics._pad_rows(g, 128)
    xp, _ = numerics._pad_rows(x, 128)
    qgc, qxc = numerics.quantize(gp, FB_A, axis="col"), numerics.quantize(xp, FB_A, axis="col")
    for q, src in ((qgc, gp), (qxc, xp)):
        ref = formats.quantize(src.cpu(), FB_A, axis="col")
        assert torch.equal(q.data.cpu(), ref.data) and torch.equal(q.scale.cpu(), ref.scale)
    dw = fp8(qgc.data, qgc.scale, (1, 128), qxc.data, qxc.scale, (1, 128), stats=stats)
    assert dw is not None and _rel(dw, formats.dequantize(qgc).t() @ formats.dequantize(qxc)) < 5e-3, fp8.errors
    assert stats.counts == {"native-fp8": 3}
    print("native FP8 recipes:", fp8.recipes)


FB_G = TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype="fp32")


class _OneLinear:
    """What FastQLinearFunction asks of its executor, for one linear outside a model."""

    def __init__(self):
        self.stats, self.native, self.fp8 = fastgemm.GemmStats(), True, fastgemm.NativeFp8Gemm()

    def weight_col_op(self, spec, fw):
        return _fake_op(fw.w16, spec.weight, axis="col")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [
    LinearSpec("t", BF16, BF16, BF16, BackwardMode.HIGH_PRECISION),
    LinearSpec("t", MX, MX, MX, BackwardMode.QUANTIZED),
    LinearSpec("t", MX, MX, BF16, BackwardMode.HIGH_PRECISION),
    LinearSpec("t", MX, MX, BF16, BackwardMode.DEQUANTIZED),
    LinearSpec("t", NV_T, NV_ROW, BF16, BackwardMode.HIGH_PRECISION),
    LinearSpec("t", NV_T, NV_ROW, BF16, BackwardMode.DEQUANTIZED),
    LinearSpec("t", FB_W, FB_A, FB_G, BackwardMode.QUANTIZED)], ids=lambda s: f"{s.weight.short()}-{s.backward}")
def test_fast_linear_on_cuda_matches_reference_linear(spec):
    """One linear, same operands, fast path vs reference emulation on the H200: forward, dgrad and wgrad within
    fp32-accumulation tolerance for the tensor-core paths (exact operands), within the FP8 GEMM's block
    accumulation for native FP8; and the native path reports native GEMMs (no emulation fallback)."""
    _need_sm90()
    from precision_dsl.engine.qlinear import FastQLinearFunction, FastWeight, QLinearFunction, quantize_weights

    class _Plan:  # quantize_weights needs by_name / share_scale_groups only
        share_scale_groups = ()

        @staticmethod
        def by_name():
            from types import SimpleNamespace

            return {"t": SimpleNamespace(is_linear=True, share_scale_group=None,
                                         precision=SimpleNamespace(weight=spec.weight))}

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1000, 512, generator=g).cuda()  # 1000 tokens: not a multiple of 32 / 128 (padding paths)
    w = (torch.randn(1024, 512, generator=g) * 0.05).cuda()
    gy = torch.randn(1000, 1024, generator=g).cuda()
    qw = quantize_weights(_Plan, {"t": w})["t"]
    w16 = w.to(torch.bfloat16)
    ref_w = qw.float() if isinstance(qw, torch.Tensor) else formats.dequantize(qw)
    out = {}
    for mode in ("reference", "fast"):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if mode == "reference":
            y = QLinearFunction.apply(xi, wi, ref_w, spec)
        else:
            ex = _OneLinear()
            fw = FastWeight(w16, fastgemm.Op(w16) if isinstance(qw, torch.Tensor) else fastgemm.decode_op(qw),
                            q=None if isinstance(qw, torch.Tensor) else qw)
            y = FastQLinearFunction.apply(xi, wi, fw, spec, ex)
        y.backward(gy)
        out[mode] = (y.detach(), xi.grad, wi.grad)
    tol = 1e-2 if spec.weight.kind == FormatKind.FP8_BLOCK else 1e-5
    for a, b, what in zip(out["fast"], out["reference"], ("y", "dx", "dw")):
        assert _rel(a, b) < tol, (what, _rel(a, b), ex.fp8.errors)
    if spec.weight.kind == FormatKind.FP8_BLOCK:
        assert ex.stats.counts == {"native-fp8": 3}, (ex.stats.counts, ex.fp8.errors)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["fp8-blockwise-hopper", "mxfp8-e2e", "nvfp4-pertoken-dequant-backward",
                                    "mxfp8-hp-backward", "bf16"])
def test_fast_executor_on_cuda_matches_reference_emulation(policy):
    """The fast path on the H200 (tensor cores; native FP8 for fp8_block) against the reference emulation on the
    same device and weights: forward and gradients within GEMM-accumulation tolerance (FP8: the native GEMM
    accumulates in fp32 per 128-wide K block), and it reports which GEMMs ran natively."""
    _need_sm90()
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    plan = load_plan(policy, load_architecture("tiny-moe"))
    ids = torch.randint(3, 32, (16, 24), generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for mode in ("reference", "fast"):
        model = load_model(resolve_model_dir("tiny-moe")).cuda()
        ex = TrainerExecutor(plan, model, gemm=mode).install()
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        out[mode] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}, ex)
    (lr, gr, _), (lf, gf, exf) = out["reference"], out["fast"]
    paths = exf.gemm_report()
    # whole model: a rounding-level difference can flip a token's MoE top-k choice or a quantized element
    # downstream, so this catches gross errors only (a wrong transpose or scale is O(1)); the per-linear test below
    # is the tight one
    assert _rel(lf, lr) < 5e-2
    if not policy.startswith("fp8"):  # FP8 GEMMs accumulate in FP8 tensor-core precision: more top-k flips
        for n in gr:
            assert _rel(gf[n], gr[n]) < 0.2 if gr[n].norm() > 0 else True, (n, _rel(gf[n], gr[n]))
    if policy.startswith("fp8"):
        assert paths.get("native-fp8", 0) > 0, paths
    else:
        assert "native-fp8" not in paths and paths.get("bf16-tc", 0) > 0, paths


@pytest.mark.gpu
def test_mxfp8_rowcol_operands_equal_separate_quantizations():
    """The quantized-backward MXFP8 operands made from one read (row + col copies in one launch) are bitwise the
    separately quantized ones, for token counts that are and are not whole 32-row blocks."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from precision_dsl.engine.qlinear import _fake_ops_rowcol

    for m in (1000, 1, 64):
        x = _x(m, 512).cuda().to(torch.bfloat16)
        for fmt in (MX, MX5):
            row, col = _fake_ops_rowcol(x, fmt)
            for got, axis in ((row, "row"), (col, "col")):
                want = _fake_op(x, fmt, axis=axis)
                assert torch.equal(got.v.view(torch.int16), want.v.view(torch.int16)), (m, fmt.short(), axis)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100, 128, 1000])
def test_fp8_rows16_pads_in_place_with_the_reference_bytes(m):
    """The native-FP8 activation operand quantized straight into a buffer of roundup(M, 16) rows: its first M rows
    are the quantizer's bytes, the rest zero bytes with scale 1 (what NativeFp8Gemm's own padding appends)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from precision_dsl.engine.fastgemm import fp8_rows16 as _fp8_rows16

    x = _x(m=m, k=384).to(torch.bfloat16).cuda()
    q, data, scale = _fp8_rows16(x, FB_A)
    ref = formats.quantize(x.cpu(), FB_A)
    assert torch.equal(q.data.cpu(), ref.data) and torch.equal(q.scale.cpu(), ref.scale)
    m16 = -(-m // 16) * 16
    assert data.shape == (m16, 384) and scale.shape == (m16, 3)
    assert torch.equal(data[:m].cpu(), ref.data) and torch.equal(scale[:m].cpu(), ref.scale)
    assert not data[m:].any() and bool((scale[m:] == 1).all())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100, 128, 1000])
def test_fp8_rowcol16_is_the_two_reference_copies(m):
    """g's rowwise copy (in a 16-row-padded buffer) and its columnwise copy over tokens zero-padded to 128, from one
    launch: the reference's bytes for each (the columnwise one = the reference on the zero-padded g)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from precision_dsl.engine.fastgemm import fp8_rowcol16

    g = _x(m=m, k=384, seed=4).to(torch.bfloat16)
    q_row, data, scale, q_col = fp8_rowcol16(g.cuda(), FB_A)
    ref_row = formats.quantize(g, FB_A)
    mp = -(-m // 128) * 128
    ref_col = formats.quantize(torch.cat([g, g.new_zeros(mp - m, 384)]), FB_A, axis="col")
    assert torch.equal(q_row.data.cpu(), ref_row.data) and torch.equal(q_row.scale.cpu(), ref_row.scale)
    assert torch.equal(q_col.data.cpu(), ref_col.data) and torch.equal(q_col.scale.cpu(), ref_col.scale)
    m16 = -(-m // 16) * 16
    assert data.shape == (m16, 384) and not data[m:].any() and bool((scale[m:] == 1).all())


@pytest.mark.parametrize("policy", ["fp8-blockwise-hopper", "mxfp8-hp-backward"])
def test_autograd_graph_keeps_only_backward_operands_of_shared_inputs(monkeypatch, policy):
    """After a forward, the linears' contexts hold of each shared input only what the backward reads (its BF16 copy
    and columnwise copies), not the forward's quantized / decoded operands - except the input still being read."""
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan
    from precision_dsl.engine.qlinear import SharedInput

    dropped = []
    done = SharedInput.forward_done
    monkeypatch.setattr(SharedInput, "forward_done", lambda self: dropped.extend(
        k for k in self._derived if k[0] not in SharedInput.BACKWARD_KEYS) or done(self))
    model = load_model(resolve_model_dir("tiny-moe"))
    ex = TrainerExecutor(load_plan(policy, load_architecture("tiny-moe")), model, gemm="fast").install()
    logits = model(torch.randint(3, 32, (4, 24), generator=torch.Generator().manual_seed(0)))
    assert dropped  # the forward made forward-only operands, and they were freed
    shared, seen, todo = set(), set(), [logits.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        xs = getattr(node, "xs", None)
        if isinstance(xs, SharedInput):
            shared.add(xs)
        todo += [f for f, _ in node.next_functions]
    current = ex._inputs.current
    assert len(shared) > 10 and current in shared
    for xs in shared - {current}:
        assert all(k[0] in SharedInput.BACKWARD_KEYS for k in xs._derived), list(xs._derived)
    logits.float().pow(2).mean().backward()  # and the backward still runs on what is left


@pytest.mark.parametrize("policy", ["fp8-blockwise-hopper", "nvfp4-pertoken-dequant-backward"])
def test_executors_run_under_inference_mode(policy):
    """Inference tensors carry no version counter: the input sharing skips them instead of failing."""
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.model import load_model, resolve_model_dir
    from precision_dsl.engine.plans import load_plan

    plan = load_plan(policy, load_architecture("tiny-moe"))
    model = load_model(resolve_model_dir("tiny-moe"))
    ids = torch.randint(3, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    TrainerExecutor(plan, model, gemm="fast").install()
    with torch.no_grad():
        want = model(ids)
    with torch.inference_mode():
        got = model(ids)
    assert torch.equal(got, want)


def test_scale_layout_candidates_in_order_each_holding_the_scales():
    """NativeFp8Gemm's scale layouts: the candidates in the order tried (documented one first; the L4-padded 128x128
    grid only where L % 4 != 0), and every one built by fastgemm._layout - the only builder, also of the hot path's
    verified layout - holding the scales' values (A as [M, C/128]; B as the [C/128, N] or [L, N/128] transpose)."""
    from precision_dsl.engine.fastgemm import _layout, _scale_layouts

    a_forms = ["a-m4/", "", "a-contig/"]
    g = torch.Generator().manual_seed(0)
    for m, l_a, b_block, b_shape, b_forms in (
            (37, 24, (128, 128), (16, 24), ["b128:l4-view", "b128:contig"]),
            (64, 16, (128, 128), (4, 6), ["b128:l4-view", "b128:contig", "b128:l4-padded"]),
            (48, 2, (1, 128), (3072, 2), ["b1x128:m4", "b1x128:t-contig", "b1x128:t-view"]),
            (13, 3, (1, 128), (2048, 3), ["b1x128:m4", "b1x128:t-contig", "b1x128:t-view"])):
        a_scale = torch.rand(m, l_a, generator=g)
        b_scale = torch.rand(*b_shape, generator=g)
        forms = _scale_layouts(b_scale, b_block)
        assert forms == [(a, b) for a in a_forms for b in b_forms]
        for form in forms:
            sa, sb = _layout(form, a_scale, b_scale, b_block)
            assert torch.equal(sa, a_scale), form
            assert torch.equal(sb[:b_scale.shape[1]], b_scale.t()) and sb.shape[1] == b_scale.shape[0], form
        sa, _ = _layout(("a-m4/", b_forms[0]), a_scale, b_scale, b_block)  # 16-byte aligned columns
        assert sa.stride() == (1, -(-m // 4) * 4)
