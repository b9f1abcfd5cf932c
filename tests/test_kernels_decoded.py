"""One-launch quantize-and-decode (kernels.quantize_decoded / quantize_with_decoded): rowwise MXFP8 1x32 and NVFP4
1x16 (per row, per tensor) GEMM operands written as their decoded bf16 values by the quantize kernel itself, bitwise
what the two-launch path gives (`fastgemm.decode_op(kernels.quantize(x, fmt))`: quantize kernel, then the
triton_decode kernel), NVFP4's S_dec kept apart for the epilogue.

On CPU (CI): the kernels under Triton's interpreter in a fresh process (tests/decoded_interpreted.py), against the
reference quantizers and the decode kernels; what they decline. On the H200 (`-m gpu`): against decode_op(quantize)
on random and edge-case inputs (NaN, +-inf, zero / -0.0 blocks, tiny and subnormal blocks, saturation) of several
shapes, and the trainer / rollout callers that use it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from precision_dsl import kernels
from precision_dsl.precision import FormatKind, TensorFormat

MX = TensorFormat(kind=FormatKind.MXFP8, element="e4m3", block=(1, 32), scale_dtype="e8m0")
MX5 = TensorFormat(kind=FormatKind.MXFP8, element="e5m2", block=(1, 32), scale_dtype="e8m0")
NV_ROW = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row")
NV_T = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="tensor")
NV_E = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="expert")
FORMATS = (MX, MX5, NV_ROW, NV_T, NV_E)


def test_one_launch_quantize_decode_is_bitwise_the_reference_under_the_interpreter():
    """tests/decoded_interpreted.py under TRITON_INTERPRET=1 (fresh process): for MXFP8 e4m3/e5m2 and NVFP4 per
    row / per tensor, bf16/fp32/fp16 inputs, M = 37 / 1 / 3, K = 256 / 3072 / 64, zero / -0.0 / tiny / saturating /
    +-inf blocks: values == the decode kernels of the reference bytes, values * s_dec == formats.dequantize(reference),
    s_dec and the optional bytes == the reference's; unsupported formats and shapes are declined (None)."""
    script = Path(__file__).with_name("decoded_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 5 * 3 * 4 + 1 and rows[-1]["case"] == "declines", [r["case"] for r in rows]
    bad = {r["case"]: [k for k, ok in r["checks"].items() if not ok] for r in rows
           if not r["checks"] or not all(r["checks"].values())}
    assert not bad, f"one-launch quantize-decode differs from the reference: {bad}"


def test_quantize_decoded_declines_cpu_tensors_without_the_interpreter():
    """Off the GPU (and not under TRITON_INTERPRET=1) there is nothing to launch: None, the callers' existing path
    runs (kernels.quantize falls back to the reference there)."""
    assert os.environ.get("TRITON_INTERPRET") != "1"
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for fmt in FORMATS:
        assert kernels.quantize_decoded(x, fmt) is None
        assert kernels.quantize_with_decoded(x, fmt) is None


# ---------------------------------------------------------------------------------------------------------------
# GPU (H200): bitwise against the two-launch path
# ---------------------------------------------------------------------------------------------------------------
def _gpu_ok() -> bool:
    return torch.cuda.is_available() and kernels.available()


needs_gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU with compute capability >= 8.9 and Triton "
                                                     "(run on the H200 via the device tool)")


def _edge_x(m: int, k: int, seed: int) -> torch.Tensor:
    """fp32 [m, k]: rows over ~40 binades, then edge-case blocks written into the first rows that exist."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-30, 12, (m, 1), generator=g).float())
    edits = [
        lambda r: r.__setitem__(slice(0, 32), 0.0),  # all-zero block
        lambda r: r.__setitem__(slice(0, 32), -0.0),  # all -0.0 block
        lambda r: (r.__setitem__(slice(0, 32), 1e-39), r.__setitem__(3, -2e-39)),  # fp32 subnormals: E8M0 = 0
        lambda r: r.__setitem__(slice(0, 32), 3e-37 * torch.randn(32, generator=g)),  # E8M0 < 3: bf16 rounds
        lambda r: r.__setitem__(slice(0, 32), 1e-30 * torch.randn(32, generator=g)),  # tiny block
        lambda r: (r.__setitem__(5, 3e38), r.__setitem__(6, -3.3e38)),  # top of E8M0, saturation
        lambda r: (r.__setitem__(1, float("inf")), r.__setitem__(2, float("-inf"))),  # +-inf
        lambda r: (r.__setitem__(1, float("nan")), r.__setitem__(17, float("nan"))),  # NaN elements
        lambda r: r.__setitem__(slice(0, 32), float("nan")),  # all-NaN block
        lambda r: (r.__setitem__(slice(0, 16), -1e-3), r.__setitem__(16, 1e4)),  # -> -0.0 next to a large element
        lambda r: r.__setitem__(slice(None), 6.0 * torch.arange(k).remainder(13).float() - 36.0),  # E2M1 ties
    ]
    for i, edit in enumerate(edits[:m]):
        edit(x[i])
    return x


SHAPES = [(1, 3072), (1, 64), (37, 256), (3, 3072), (300, 512), (4100, 512), (16, 7168), (5, 18432), (2, 32768),
          (2, 40960)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m,k", SHAPES)
def test_one_launch_values_are_bitwise_decode_op_of_quantize_on_gpu(m, k):
    """values (and s_dec) of quantize_decoded == fastgemm.decode_op(kernels.quantize(x, fmt)) .v (and .s), bitwise,
    for MXFP8 e4m3/e5m2 and NVFP4 per row / tensor / expert, bf16/fp32/fp16 inputs, random rows + edge-case blocks
    (NaN, +-inf, zero / -0.0, subnormal, E8M0 < 3, saturation); quantize_with_decoded's bytes == kernels.quantize's."""
    from precision_dsl.engine import fastgemm
    from precision_dsl.kernels import triton_nvfp4

    x32 = _edge_x(m, k, seed=m * 7 + k)
    bad = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = x32.to(dtype).cuda()
        for fmt in FORMATS:
            got = kernels.quantize_decoded(x, fmt)
            if fmt is NV_ROW and kernels._nv_row_blocks(k) * 8 > triton_nvfp4.ROW_DECODED_MAX_PAIRS:
                assert got is None  # rows too long for one register-resident pass: the two-launch path runs
                continue
            assert got is not None, (fmt.short(), m, k, dtype)
            v, s = got
            q = kernels.quantize(x, fmt, kernel="triton")
            want = fastgemm.decode_op(q)
            assert v.dtype == torch.bfloat16 and v.shape == want.v.shape == x.shape
            if not torch.equal(v.view(torch.int16), want.v.view(torch.int16)):
                idx = (v.view(torch.int16) != want.v.view(torch.int16)).nonzero()[:3].tolist()
                bad.append((fmt.short(), str(dtype), "values", [(i, float(x[tuple(i)]), float(v[tuple(i)]),
                                                                 float(want.v[tuple(i)])) for i in idx]))
            if (s is None) != (want.s is None) or (s is not None and not torch.equal(s.view(torch.int32),
                                                                                     want.s.view(torch.int32))):
                bad.append((fmt.short(), str(dtype), "s_dec"))
            q2, v2, s2 = kernels.quantize_with_decoded(x, fmt)
            same = torch.equal(v2.view(torch.int16), v.view(torch.int16)) and torch.equal(q2.data, q.data) \
                and torch.equal(q2.scale, q.scale)
            if fmt.kind == FormatKind.NVFP4:
                same = same and torch.equal(q2.global_scale, q.global_scale) \
                    and torch.equal(q2.global_amax.view(torch.int32), q.global_amax.view(torch.int32))
            if not same:
                bad.append((fmt.short(), str(dtype), "with-bytes"))
    assert not bad, bad


@pytest.mark.gpu
@needs_gpu
def test_trainer_and_rollout_operands_use_the_one_launch_path_on_gpu(monkeypatch):
    """qlinear._fake_op (rowwise, parts == 1) and rollout_gemm._fused_operand take kernels.quantize_decoded for MXFP8 /
    NVFP4, with the same operands as before: _fake_op's dense() == numerics.fake_quantize bitwise, the rollout operand
    == rollout_quant's; columnwise copies and expert-TP partitions keep the two-launch path."""
    from precision_dsl.engine import numerics
    from precision_dsl.engine import rollout_gemm as rg
    from precision_dsl.engine.qlinear import _fake_op

    calls = []
    real = kernels.quantize_decoded
    monkeypatch.setattr(kernels, "quantize_decoded", lambda x, fmt: calls.append(fmt) or real(x, fmt))
    x = _edge_x(300, 512, seed=5)
    # the CPU reference's dense values are fp32: leave out the blocks that are not bf16-exact (E8M0 < 3, documented in
    # fastgemm) and the non-finite ones (the CPU reference's max propagates NaN)
    x[2:4] = 1.0
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    x16 = x.to(torch.bfloat16)
    for fmt in (MX, MX5, NV_ROW, NV_T):
        calls.clear()
        op = _fake_op(x16.cuda(), fmt)
        assert calls == [fmt]
        want = numerics.fake_quantize(x16.float(), fmt)
        assert torch.equal(op.dense().cpu().view(torch.int32), want.view(torch.int32)), fmt.short()
        calls.clear()
        a, b = rg.activation_operand(x16.cuda(), fmt, fused=True), rg.activation_operand(x16.cuda(), fmt, fused=False)
        assert calls == [fmt]
        assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16)), fmt.short()
        assert (a.gscale is None and b.gscale is None) or torch.equal(a.gscale, b.gscale), fmt.short()
        calls.clear()
        if fmt.kind == FormatKind.MXFP8:
            _fake_op(x16.cuda(), fmt, axis="col")
        _fake_op(x16.cuda(), fmt, parts=2)
        assert calls == [], "columnwise / expert-TP operands must keep the two-launch path"
