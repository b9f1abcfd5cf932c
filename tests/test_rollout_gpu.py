"""GPU checks of the independent rollout path (run on the H200 through benchmarks/device_ablate.sh): the rollout's
quantizers give the same bytes on CUDA as on CPU, FP8 GEMMs take the native torch._scaled_mm path and agree with
the spelled-out block-scaled CPU math, and an RL run on CUDA keeps the received weights byte-identical."""

from __future__ import annotations

import pytest
import torch

from precision_dsl.engine import rollout_gemm as rg
from precision_dsl.engine import rollout_quant as rq
from precision_dsl.precision import FormatKind, TensorFormat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_rollout_quantizers_same_bytes_on_cuda():
    x = (torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    xc = x.cuda()
    for a, b in zip(rq.mxfp8(x), rq.mxfp8(xc)):
        assert torch.equal(a, b.cpu())
    for per_row in (True, False):
        for a, b in zip(rq.nvfp4(x, per_row), rq.nvfp4(xc, per_row)):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8 else a, b.cpu())
    for block in ((1, 128), (128, 128)):
        for a, b in zip(rq.fp8_block(x, "e4m3", block, True), rq.fp8_block(xc, "e4m3", block, True)):
            assert torch.equal(a, b.cpu())


def test_fused_kernel_operands_equal_rollout_quant_operands():
    """On CUDA the rollout quantizes activations with the fused kernels: the operands (values, scales) equal those
    of its own rollout_quant implementation exactly."""
    x = (torch.randn(300, 512, generator=torch.Generator().manual_seed(2)) * 3).bfloat16().cuda()
    fmts = [TensorFormat(kind=FormatKind.MXFP8, element=e, block=(1, 32), scale_dtype="e8m0") for e in ("e4m3", "e5m2")]
    fmts += [TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale=g)
             for g in ("row", "tensor")]
    fmts += [TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype=s)
             for s in ("fp32", "pow2")]
    for fmt in fmts:
        a, b = rg.activation_operand(x, fmt, fused=True), rg.activation_operand(x, fmt, fused=False)
        assert a.kind == b.kind and a.block == b.block, fmt
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)), fmt
        for u, v in ((a.gscale, b.gscale), (a.scale_inv, b.scale_inv)):
            assert (u is None and v is None) or torch.equal(u, v), fmt


def test_fp8_block_gemm_native_scaled_mm_matches_cpu_math():
    from precision_dsl import formats

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=g).bfloat16()
    w = (torch.randn(384, 512, generator=g) * 0.05).bfloat16()
    act = TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128), scale_dtype="fp32")
    wfmt = formats.fp8_block.make_format("e4m3", (128, 128), False)
    wq = formats.quantize(w, wfmt)
    cpu = rg.gemm(rg.activation_operand(x, act), rg.weight_operand(wq, "cpu"))
    from precision_dsl.engine.fastgemm import NativeFp8Gemm

    paths: dict = {}
    fp8 = NativeFp8Gemm()
    gpu = rg.gemm(rg.activation_operand(x.cuda(), act), rg.weight_operand(wq, "cuda"), paths, fp8).cpu()
    print("fp8 block GEMM paths:", paths)
    assert paths.get("fp8-scaled_mm"), (paths, fp8.errors)
    rel = (gpu - cpu).norm() / cpu.norm()
    assert rel < 1e-2, rel


def test_run_on_cuda_independent_rollout_bytes_identical():
    from precision_dsl.engine.loop import RunConfig, run

    res = run(RunConfig(policy="nvfp4-pertoken-dequant-backward", steps=2, device="cuda", prompts_per_step=8,
                        routing_replay=True))
    assert all(m.quantized_weights_identical for m in res.steps)
    assert all(0 < m.mismatch_abs_logp < 0.2 for m in res.steps)


def test_weight_operands_from_decode_kernels_equal_eager_decode():
    """Received MXFP8 / NVFP4 weights are decoded on a GPU by the one-pass kernels: values and epilogue scales are
    bitwise those of the eager decode (run here on CPU)."""
    from precision_dsl import formats

    w = (torch.randn(384, 512, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    w[5, :32] = 0.0
    w[6, :16] = -0.0
    fmts = [TensorFormat(kind=FormatKind.MXFP8, element=e, block=(1, 32), scale_dtype="e8m0") for e in ("e4m3", "e5m2")]
    fmts += [TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3",
                          global_scale="tensor")]
    for fmt in fmts:
        q = formats.quantize(w, fmt)
        cpu, gpu = rg.weight_operand(q, "cpu"), rg.weight_operand(q, "cuda")
        assert torch.equal(cpu.values.view(torch.int16), gpu.values.cpu().view(torch.int16)), fmt.short()
        assert (cpu.gscale is None and gpu.gscale is None) or torch.equal(cpu.gscale, gpu.gscale.cpu()), fmt.short()
