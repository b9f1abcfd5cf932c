"""The fused NVFP4 segment kernel (triton_segments.nvfp4_segment_fused: amax + quantize in one persistent launch, the
weights read from HBM once) gives exactly the bytes of the two-kernel path (seg_amax + nvfp4_segment, itself tested
against the reference in tests/test_kernels_interpret.py and tests/test_weight_update_gpu.py): every group amax,
data / scale / S_dec byte, the input_scale fill and the non-finite count.

Cases: one member per group and gate + up share-scale groups of two members; bf16 / fp16 / fp32; one chunk and many
chunks (the queue's interleaving of amax and quantize tiles); rows per chunk not a multiple of the tile rows; a
block count that is not a multiple of the tile's; bf16 subnormal groups; NaN / Inf counted. On CPU the cases run in
a child process under Triton's interpreter (TRITON_INTERPRET=1; small shapes, the interpreter is numpy-slow); on
CUDA (marked gpu) the same cases plus larger ones run compiled, where the queue's cross-program waits are real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triton  # noqa: F401  (in the test extra: a missing interpreter fails, never skips)

ROOT = Path(__file__).resolve().parent.parent

# (rows_per_member, rows_per_group, members, K, dtype, chunk groups, launch, special)
CASES = [
    (6, 6, 5, 96, "bfloat16", 1, dict(block_m=4, block_nb=2), ""),  # 6-row chunks, 4-row tiles: a ragged tile
    (6, 12, 4, 96, "bfloat16", 1, dict(block_m=4, block_nb=4), ""),  # gate + up share-scale groups, 2 chunks
    (8, 16, 4, 224, "bfloat16", 8, dict(), ""),  # one chunk, 14 blocks a row (partial block tile)
    (8, 8, 6, 64, "bfloat16", 2, dict(block_m=2, block_nb=2), "subnormal"),
    (8, 8, 6, 64, "bfloat16", 1, dict(block_m=2, block_nb=4), "nonfinite"),
    (4, 8, 4, 32, "float16", 1, dict(block_m=2, block_nb=1), ""),
    (4, 4, 5, 48, "float32", 2, dict(block_m=4, block_nb=2), "nonfinite"),
]
GPU_CASES = CASES + [
    (768, 1536, 32, 2048, "bfloat16", 1, dict(), ""),  # Qwen3-30B-A3B experts' gate/up: many chunks, real waits
    (2048, 2048, 16, 768, "bfloat16", 0, dict(), ""),  # its down_proj (chunk_bytes default: 16 MiB)
    (512, 1024, 24, 1024, "bfloat16", 0, dict(block_m=2, block_nb=64, num_warps=2, programs_per_sm=8), ""),
]


def _input(rpm, rpg, members, k, dtype, special, seed, dev):
    g = torch.Generator().manual_seed(seed)
    m = rpm * members
    x = torch.randn(m, k, generator=g) * 0.05
    x[::7] *= torch.exp(torch.randn(x[::7].shape[0], 1, generator=g) * 3)
    x[1] = 0.0
    x[2, ::3] = -0.0
    if special == "subnormal":  # a whole group of bf16 subnormals (|x| < 2^-126), and one mixed group
        x[rpg:2 * rpg] = torch.randn(rpg, k, generator=g) * 1e-39
        x[2 * rpg, 5] = -3e-40
    x = x.to(getattr(torch, dtype))
    if special == "nonfinite":
        x[3, 7], x[m - 1, k - 1], x[rpg + 1, 0] = float("nan"), float("inf"), float("-inf")
    return x.to(dev)


def run_case(i: int, case: tuple, dev: str) -> dict:
    """Both paths on case i; {check name: equal}."""
    from precision_dsl.kernels import triton_segments as ks

    rpm, rpg, members, k, dtype, chunk_groups, launch, special = case
    x = _input(rpm, rpg, members, k, dtype, special, 100 + i, dev)
    m = x.shape[0]

    def outs():
        return (torch.zeros(m // rpg, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                torch.full((m, k // 2), 0xAA, dtype=torch.uint8, device=dev),
                torch.full((m, k // 16), 0xAA, dtype=torch.uint8, device=dev),
                torch.full((m // rpm,), -1.0, device=dev))

    bits, bad, data, scale, sdec = outs()
    ks.seg_amax(x, rpg, bits, bad)
    ks.nvfp4_segment(x, bits.view(torch.float32), rpg, rpm, data, scale, sdec)
    fbits, fbad, fdata, fscale, fsdec = outs()
    isc = torch.zeros(m // rpm, device=dev)
    kw = dict(launch)
    if chunk_groups:
        kw["chunk_bytes"] = chunk_groups * rpg * k * x.element_size()
    ks.nvfp4_segment_fused(x, rpg, rpm, fdata, fscale, fsdec, fbad, isc, amax_bits=fbits, **kw)
    same = lambda a, b: bool(torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)))  # noqa: E731
    checks = {"amax": same(bits, fbits), "bad": int(bad.item()) == int(fbad.item()), "data": same(data, fdata),
              "scale": same(scale, fscale), "sdec": same(sdec, fsdec), "input_scale": bool((isc == 1).all())}
    if special == "nonfinite":
        checks["counted"] = int(fbad.item()) == 3
    # again without the caller's amax buffer (the workspace path the update program uses)
    gbits, gbad, gdata, gscale, gsdec = outs()
    ks.nvfp4_segment_fused(x, rpg, rpm, gdata, gscale, gsdec, gbad, **kw)
    checks["workspace"] = same(gdata, data) and same(gscale, scale) and same(gsdec, sdec)
    return checks


def _interpreted() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["case"]: r["checks"] for r in map(json.loads, out.stdout.splitlines())}


def test_fused_equals_two_kernel_path_interpreted():
    results = _interpreted()
    assert len(results) == len(CASES)
    bad = {c: [n for n, ok in checks.items() if not ok] for c, checks in results.items()}
    assert not any(bad.values()), bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("i", range(len(GPU_CASES)))
def test_fused_equals_two_kernel_path_gpu(i):
    for rep in range(3):  # the queue's order across programs differs run to run: the bytes must not
        checks = run_case(i, GPU_CASES[i], "cuda")
        assert all(checks.values()), (rep, checks)


if __name__ == "__main__":  # the interpreter child
    for i, case in enumerate(CASES):
        print(json.dumps({"case": i, "checks": run_case(i, case, "cpu")}), flush=True)
