"""The fused Triton kernels (precision_dsl/kernels, ~760 lines) run on CPU in CI, under Triton's interpreter
(TRITON_INTERPRET=1), byte for byte against the TE golden vectors. tests/test_kernels.py runs the compiled kernels
on a GPU (`-m gpu`, the H200); this file is what a CPU-only CI can check of them on every commit.

Covered (every output byte compared): NVFP4 per-tensor, per-row, 16x16 tiles, a given share-scale amax, rowwise and
columnwise; MXFP8 1x32 / 32x1, e4m3 and e5m2; FP8 block 1x128 / 128x128, pow2 and fp32 scales, rowwise and
columnwise; bf16 and fp32 inputs; the golden cases of at most 8192 elements (the interpreter is numpy-slow).
Not covered here, and why (see tests/kernels_interpreted.py):
  * MXFP8 32x32 tiles: there is no kernel; kernel="triton" refuses them (tested below).
  * inputs with NaN (golden `nan_inf`): the interpreter's block max propagates NaN, the GPU's max.f32 ignores it.
  * the fp32 -> fp8 conversion instruction itself: the interpreter's cast is not cvt.rn.satfinite, so the check
    substitutes the PTX rule for that one operation; the instruction is exercised on the H200 only. Likewise the
    bf16 -> fp32 widening: the interpreter's loses bf16 subnormals, the check uses the hardware's exact bit shift.
  * launch-config sweeps and the one-read MXFP8 row+col kernel on shapes above the size limit (GPU tests).
FP8 block copies of the fp8 backward (no golden vectors: random inputs with edge rows vs the reference): the
columnwise 1x128 copy of x zero-padded to a multiple of 128 rows in one launch (`fp8_block_quantize(...,
pad_rows_to=128)`) and both 1x128 copies from one read (`fp8_block_quantize_rowcol`), e4m3/e5m2, pow2/fp32 scales,
bf16/fp32, partial K blocks, zeros, tiny / near-saturation / +-Inf rows (NaN: GPU test only, see above).
NVFP4 kernels of the live weight update (no golden vectors: random inputs vs the reference): the segment kernels
(`triton_segments.seg_amax` / `nvfp4_segment`, per-member and gate+up share-scale groups, bf16/fp16/fp32, several
launch shapes, the non-finite count) and the register-chunked per-row kernel; the two-pass per-row loop kernel runs
on the GPU only (the interpreter cannot loop over a kernel argument).
bf16 subnormal tiles (no golden vectors: vs the reference): every kernel that reads bf16, blocks of subnormals only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import kernels_interpreted as ki
import triton  # noqa: F401  (in the test extra: a missing interpreter fails, never skips)


def _interpret(*args: str) -> dict:
    return {r["case"]: r for r in ki.interpreted_rows(Path(ki.__file__), *args)}


GOLDEN_KINDS = ("nvfp4", "mxfp8", "fp8block")


def test_the_small_golden_cases_cover_every_kernel_kind():
    assert (ki.GOLDEN_DIR / "index.json").exists(), f"golden vectors not found at {ki.GOLDEN_DIR}"
    expected = ki.cases(8192)
    assert len(expected) >= 25 and {f.split("__")[0] for f, _ in expected} == set(GOLDEN_KINDS)


@pytest.mark.parametrize("kind", GOLDEN_KINDS)
def test_every_small_golden_case_runs_the_kernel_and_matches(kind):
    assert (ki.GOLDEN_DIR / "index.json").exists(), f"golden vectors not found at {ki.GOLDEN_DIR}"
    results = _interpret("8192", kind)
    expected = {f"{f}::{v}" for f, v in ki.cases(8192) if f.startswith(f"{kind}__")}
    assert expected and set(results) == expected
    bad = {c: [k for k, ok in r["checks"].items() if not ok] for c, r in results.items()
           if r["paths"] != ["triton"] or not all(r["checks"].values()) or not r["checks"]}
    assert not bad, f"interpreted kernels differ from the golden vectors: {bad}"


def test_nvfp4_segment_kernels_and_row_variants_match_the_reference():
    """The weight update's grouped kernels (triton_segments.seg_amax + nvfp4_segment: members stacked in one
    launch, one amax per member or per gate+up share-scale group) give every member the bytes of quantizing it
    alone (data, scale, S_dec; the group amax itself), for bf16 / fp16 / fp32 and several launch shapes, and count
    non-finite elements; the register-chunked and multi-row per-row NVFP4 kernels match the per-row reference
    (kernels_interpreted.run_nvfp4_segments)."""
    results = _interpret("nvfp4_segments")
    assert len(results) == len(ki.nvfp4_segment_cases()) >= 20
    bad = {c: [k for k, ok in r["checks"].items() if not ok] for c, r in results.items()
           if not r["checks"] or not all(r["checks"].values())}
    assert not bad, f"interpreted NVFP4 segment / per-row kernels differ from the reference: {bad}"


def test_kernel_choice_is_explicit_and_refuses_what_cannot_run():
    """kernels.quantize(x, fmt, kernel=...): "auto" on a CPU tensor and "reference" run the reference and say so;
    "triton" is refused by name when it cannot run (no interpreter here, an uncovered format or shape) -- never a
    silent fallback; an unknown choice is an error."""
    from precision_dsl import kernels
    from precision_dsl.formats import FormatInputError
    from precision_dsl.formats import quantize as reference
    from precision_dsl.precision import TensorFormat

    fmt = TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row")
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    want = reference(x, fmt)
    for kernel in ("auto", "reference"):
        q = kernels.quantize(x, fmt, kernel=kernel)
        assert q.kernel == "reference"
        assert all(torch.equal(q.tensors()[k], w) for k, w in want.tensors().items())
    assert os.environ.get("TRITON_INTERPRET") != "1"
    with pytest.raises(kernels.KernelUnavailable, match="not a CUDA tensor"):
        kernels.quantize(x, fmt, kernel="triton")
    with pytest.raises(kernels.KernelUnavailable, match="no Triton kernel for fp8"):
        kernels.quantize(x, TensorFormat(kind="fp8", element="e4m3", global_scale="tensor"), kernel="triton")
    mx32 = TensorFormat(kind="mxfp8", element="e4m3", block=(32, 32), scale_dtype="e8m0")
    with pytest.raises(kernels.KernelUnavailable):
        kernels.quantize(torch.randn(64, 64), mx32, kernel="triton")
    with pytest.raises(FormatInputError, match="kernel must be one of"):
        kernels.quantize(x, fmt, kernel="fast")


def test_fp8_block_padded_col_and_rowcol_kernels_match_the_reference():
    """fp8_block_quantize(x, axis="col", pad_rows_to=128) and fp8_block_quantize_rowcol(x) run interpreted: every
    data / scale byte, the shape (Mp, K), axis and format equal the reference quantization of
    torch.cat([x, zeros(Mp - M, K)]) (row copy: of x, unpadded); the padded columns are fp8 zero bytes; the
    reference paths of both functions give the same (kernels_interpreted.fp8_pad_rowcol_checks)."""
    results = _interpret("fp8_pad_rowcol")
    assert len(results) == len(ki.fp8_pad_rowcol_cases()) >= 30
    bad = {c: [k for k, ok in r["checks"].items() if not ok] for c, r in results.items()
           if len(r["checks"]) < 27 or not all(r["checks"].values())}
    assert not bad, f"padded / row+col FP8 block kernels differ from the reference: {bad}"


def test_bf16_subnormal_tiles_match_the_reference():
    """Blocks holding only bf16 subnormals (the case the golden vectors lack): every kernel that reads bf16 --
    MXFP8 1x32 / 32x1 and row+col, NVFP4 per-tensor / per-row / 16x16, FP8 block 1x128 / 128x128 and row+col --
    writes the reference's bytes. The subnormal rows of subnormal_input get non-zero codes (E8M0 = 0 scales the
    block by 2^127), so a kernel or an interpreter that loses subnormals cannot pass."""
    from precision_dsl.formats import mxfp8

    x = ki.subnormal_input(*ki.SUBNORMAL_SHAPE, seed=130)
    sub = x[: x.shape[0] // 2].float().abs()
    assert 0 < sub.max() < 2.0 ** -126 and (mxfp8.quantize(x, "e4m3").data[: x.shape[0] // 2] != 0).float().mean() > 0.9
    results = _interpret("subnormal")
    assert set(results) == {f"subnormal::{c}" for c in ki.subnormal_cases()} and len(results) >= 30
    bad = {c: [k for k, ok in r["checks"].items() if not ok] for c, r in results.items()
           if len(r["checks"]) < 4 or not all(r["checks"].values())}
    assert not bad, f"kernels differ from the reference on bf16 subnormal tiles: {bad}"


def test_fp8_block_pad_rows_to_is_validated_and_defaults_to_no_padding():
    from precision_dsl import kernels
    from precision_dsl.formats import FormatInputError, fp8_block

    x = ki.fp8_edge_input(100, 200, torch.bfloat16, seed=5)
    for bad in (0, -128, 1.5, True):
        with pytest.raises(FormatInputError, match="pad_rows_to must be a positive int"):
            kernels.fp8_block_quantize(x, axis="col", pad_rows_to=bad)
        with pytest.raises(FormatInputError, match="pad_rows_to must be a positive int"):
            kernels.fp8_block_quantize_rowcol(x, pad_rows_to=bad)
    q, want = kernels.fp8_block_quantize(x, axis="col"), fp8_block.quantize(x, axis="col")
    assert q.shape == want.shape == (100, 200) and torch.equal(q.data, want.data)
    # N-D input: the padding is over the flattened [M, K] view; Mp == M keeps x's own shape
    x3 = ki.fp8_edge_input(256, 128, torch.float32, seed=6).view(2, 128, 128)
    assert kernels.fp8_block_quantize(x3, axis="col", pad_rows_to=128).shape == (2, 128, 128)
    assert kernels.fp8_block_quantize(x3[:, :50], axis="col", pad_rows_to=128).shape == (128, 128)
