"""The weight update's rowwise MXFP8 kernel (triton_mxfp8.quantize_rows_flat: a contiguous [M, K] tensor as a flat
run of 1x32 blocks) against the readable reference (precision_dsl.formats.mxfp8.quantize, axis="row") and the 2-D
tile kernel (quantize_rowcol, rowwise only) byte for byte, with the non-finite count both kernels add to `bad`.

Cases: bf16 / fp16 / fp32, E4M3 and E5M2, K = 32, 96 (3 blocks a row), 768; a block count that is not a multiple
of the item (masked last program); zeros, negative zeros, bf16 subnormal blocks, rows scaled towards saturation,
NaN / Inf. On CPU in a child process under Triton's interpreter (TRITON_INTERPRET=1), on CUDA (marked gpu) compiled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_interpreted as ki  # noqa: E402  (the interpreted child runner and the hardware model)

import triton  # noqa: F401  (in the test extra: a missing interpreter fails, never skips)

ROOT = Path(__file__).resolve().parent.parent

# (M, K, dtype, element, item_blocks, special)
CASES = [
    (64, 96, "bfloat16", "e4m3", 64, "nonfinite"),  # 192 blocks: 3 items
    (40, 768, "bfloat16", "e4m3", 64, "subnormal"),
    (7, 32, "float32", "e4m3", 4, "nonfinite"),  # 7 blocks: a masked last item
    (32, 64, "float16", "e5m2", 16, ""),
    (33, 96, "bfloat16", "e5m2", 8, "nonfinite"),  # 99 blocks
]
GPU_CASES = CASES + [(4096, 2048, "bfloat16", "e4m3", 64, ""), (2048, 768, "bfloat16", "e4m3", 128, "nonfinite")]


def _input(m, k, dtype, special, seed, dev):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 4)
    x[1] = 0.0
    x[2, ::3] = -0.0
    lim = torch.finfo(getattr(torch, dtype)).max / 2
    x = x.clamp(-lim, lim)
    if special == "subnormal":
        x[4, :32] = torch.randn(32, generator=g) * 1e-39
    x = x.to(getattr(torch, dtype))
    if special == "nonfinite":
        x[3, 7], x[m - 1, k - 1], x[0, 0] = float("nan"), float("inf"), float("-inf")
    return x.to(dev)


def run_case(i: int, case: tuple, dev: str) -> dict:
    from precision_dsl.formats import mxfp8
    from precision_dsl.kernels import triton_mxfp8 as km

    m, k, dtype, element, ib, special = case
    x = _input(m, k, dtype, special, 300 + i, dev)
    bad2 = torch.zeros(1, dtype=torch.int32, device=dev)
    rd, rs, _, _ = km.quantize_rowcol(x, element, True, False, bad=bad2)
    want = mxfp8.quantize(x.cpu(), element, axis="row")
    checks = {}
    # the count on the block max (the default), element by element and no count: the same bytes and the same count
    for how, kw in (("amax_screen", dict(amax_screen=True)), ("counted", dict(amax_screen=False)), ("uncounted", {})):
        data = torch.full((m, k), 0xAA, dtype=torch.uint8, device=dev)
        scale = torch.full((m, k // 32), 0xAA, dtype=torch.uint8, device=dev)
        bad = torch.zeros(1, dtype=torch.int32, device=dev) if how != "uncounted" else None
        km.quantize_rows_flat(x, data, scale, element, bad=bad, item_blocks=ib, **kw)
        checks[f"{how}.tile_kernel.data"] = torch.equal(data, rd)
        checks[f"{how}.tile_kernel.scale"] = torch.equal(scale, rs)
        if bad is not None:
            checks[f"{how}.count"] = int(bad.item()) == int(bad2.item()) == (3 if special == "nonfinite" else 0)
        checks[f"{how}.reference.data"] = torch.equal(data.cpu(), want.data.view(torch.uint8).reshape(m, k))
        checks[f"{how}.reference.scale"] = torch.equal(scale.cpu(), want.scale.view(torch.uint8).reshape(m, k // 32))
    return checks


def test_rows_flat_refuses_what_it_cannot_take():
    from precision_dsl.kernels import triton_mxfp8 as km

    with pytest.raises(ValueError, match="K % 32"):
        km.quantize_rows_flat(torch.zeros(4, 48), torch.empty(4, 48, dtype=torch.uint8),
                              torch.empty(4, 1, dtype=torch.uint8))


def test_rows_flat_equals_reference_interpreted():
    results = {r["case"]: r["checks"] for r in ki.interpreted_rows(__file__, timeout=900)}
    assert len(results) == len(CASES)
    bad = ki.failed_checks(results)
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("i", range(len(GPU_CASES)))
def test_rows_flat_equals_reference_gpu(i):
    checks = run_case(i, GPU_CASES[i], "cuda")
    assert all(checks.values()), checks


if __name__ == "__main__":  # the interpreter child
    ki.model_the_hardware()  # the interpreter's fp8 casts, bf16 widening and max as the H200's
    for i, case in enumerate(CASES):
        print(json.dumps({"case": i, "checks": run_case(i, case, "cpu")}), flush=True)
