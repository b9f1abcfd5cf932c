"""The item kernels of the NVFP4 weight update (triton_segments.nvfp4_segment_items: the amax and the quantize
launch over a segment as a flat run of block items; nvfp4_segment_predicted: one read that quantizes with the
previous update's group amaxes plus a redo of the groups whose amax changed - first update, unchanged weights, one
group changed; nvfp4_segment_fused: both passes in one persistent launch that reads the weights from HBM once) give exactly the bytes of the row-tile pair (seg_amax + nvfp4_segment, itself
tested against the reference in tests/test_kernels_interpret.py and tests/test_weight_update_gpu.py): every group
amax, data / scale / S_dec byte, the input_scale fill and the non-finite count.

Cases: one member per group and gate + up share-scale groups of two members; bf16 / fp16 / fp32; one chunk and many
chunks (the one-pass kernel's amax-ahead pipeline and its cross-program waits); items smaller than a member; block
counts that are not a power of two (K = 96, 224, 768); bf16 subnormal groups; NaN / Inf counted. On CPU the cases
run in a child process under Triton's interpreter (TRITON_INTERPRET=1; small shapes, the interpreter is numpy-slow;
the one-pass kernel as one program); on CUDA (marked gpu) the same cases plus the real expert shapes run compiled,
with the persistent grid's programs really waiting for each other.
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

# (rows_per_member, rows_per_group, members, K, dtype, chunk groups, item launch, fused launch, special)
CASES = [
    (8, 8, 5, 64, "bfloat16", 1, dict(item_blocks=16, amax_item_blocks=16), dict(item_blocks=16), ""),  # 2 items a member
    (8, 16, 4, 96, "bfloat16", 1, dict(), dict(), ""),  # gate + up share-scale groups, 6 blocks a row, 2 chunks
    (16, 16, 4, 224, "bfloat16", 8, dict(), dict(), ""),  # one chunk, 14 blocks a row
    (16, 16, 6, 64, "bfloat16", 2, dict(item_blocks=16), dict(item_blocks=16), "subnormal"),
    (16, 16, 6, 64, "bfloat16", 1, dict(), dict(), "nonfinite"),
    (8, 16, 4, 32, "float16", 1, dict(), dict(), ""),
    (16, 16, 5, 48, "float32", 2, dict(), dict(), "nonfinite"),
]
GPU_CASES = CASES + [
    (768, 1536, 32, 2048, "bfloat16", 1, dict(), dict(), ""),  # Qwen3-30B-A3B experts' gate/up: many chunks
    (2048, 2048, 16, 768, "bfloat16", 0, dict(), dict(), ""),  # its down_proj (chunk_bytes default)
    (512, 1024, 24, 1024, "bfloat16", 0, dict(item_blocks=128, num_warps=2),
     dict(item_blocks=128, num_warps=2, programs_per_sm=8), ""),
    (1024, 1024, 8, 512, "bfloat16", 0, dict(item_blocks=512, num_warps=8),
     dict(item_blocks=512, num_warps=8, programs_per_sm=2, chunk_bytes=1 << 20), ""),
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
    """The row-tile pair, the item pair and the one-pass kernel on case i; {check name: equal}."""
    from precision_dsl.kernels import triton_segments as ks

    rpm, rpg, members, k, dtype, chunk_groups, item_launch, fused_launch, special = case
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
    same = lambda a, b: bool(torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)))  # noqa: E731
    fused_kw = dict(fused_launch)
    if chunk_groups:
        fused_kw["chunk_bytes"] = chunk_groups * rpg * k * x.element_size()
    checks = {}
    for name, fn, kw in (("items", ks.nvfp4_segment_items, item_launch), ("fused", ks.nvfp4_segment_fused, fused_kw)):
        fbits, fbad, fdata, fscale, fsdec = outs()
        isc = torch.zeros(m // rpm, device=dev)
        fn(x, rpg, rpm, fdata, fscale, fsdec, fbad, isc, amax_bits=fbits, **kw)
        checks.update({f"{name}.amax": same(bits, fbits), f"{name}.bad": int(bad.item()) == int(fbad.item()),
                       f"{name}.data": same(data, fdata), f"{name}.scale": same(scale, fscale),
                       f"{name}.sdec": same(sdec, fsdec), f"{name}.input_scale": bool((isc == 1).all())})
        if special == "nonfinite":
            checks[f"{name}.counted"] = int(fbad.item()) == 3
        # again without the caller's amax buffer or input_scale (the workspace path)
        gbits, gbad, gdata, gscale, gsdec = outs()
        fn(x, rpg, rpm, gdata, gscale, gsdec, gbad, **kw)
        checks[f"{name}.workspace"] = same(gdata, data) and same(gscale, scale) and same(gsdec, sdec)
    # the predicted kernel: a first update (no amax known), the same weights again (every prediction right), then
    # weights with one group's amax changed and the others' unchanged (a redo of exactly the changed group)
    prev = torch.full((m // rpg,), -1, dtype=torch.int32, device=dev)
    for step in ("first", "same"):
        pbits, pbad, pdata, pscale, psdec = outs()
        isc = torch.zeros(m // rpm, device=dev)
        ks.nvfp4_segment_predicted(x, rpg, rpm, pdata, pscale, psdec, pbad, prev, isc, amax_bits=pbits,
                                   **item_launch_q(item_launch))
        if special == "nonfinite":  # the update is refused: only the count matters (its amax ignores NaN)
            checks[f"predicted.{step}.counted"] = int(pbad.item()) == 3
            continue
        checks.update({f"predicted.{step}.amax": same(bits, pbits), f"predicted.{step}.prev": same(bits, prev),
                       f"predicted.{step}.bad": int(bad.item()) == int(pbad.item()),
                       f"predicted.{step}.data": same(data, pdata), f"predicted.{step}.scale": same(scale, pscale),
                       f"predicted.{step}.sdec": same(sdec, psdec),
                       f"predicted.{step}.input_scale": bool((isc == 1).all())})
    if special != "nonfinite" and m // rpg > 1:
        y = x.clone()
        y[0, 0] = y[:rpg].float().abs().max() * 2  # group 0's amax changes, the others' do not
        rbits, rbad, rdata, rscale, rsdec = outs()
        ks.seg_amax(y, rpg, rbits, rbad)
        ks.nvfp4_segment(y, rbits.view(torch.float32), rpg, rpm, rdata, rscale, rsdec)
        pbits, pbad, pdata, pscale, psdec = outs()
        ks.nvfp4_segment_predicted(y, rpg, rpm, pdata, pscale, psdec, pbad, prev, amax_bits=pbits,
                                   **item_launch_q(item_launch))
        checks.update({"predicted.changed.data": same(rdata, pdata), "predicted.changed.scale": same(rscale, pscale),
                       "predicted.changed.sdec": same(rsdec, psdec), "predicted.changed.prev": same(rbits, prev),
                       "predicted.changed.group0_moved": not same(rbits[:1], bits[:1])})
    return checks


def item_launch_q(launch: dict) -> dict:
    """The quantize-launch keys of an item launch (the predicted kernel has no separate amax launch)."""
    return {k: v for k, v in launch.items() if k in ("item_blocks", "num_warps")}


# per-tensor NVFP4 by the one-pass kernel (triton_nvfp4.per_tensor(one_pass=True)): (M, K, dtype)
PER_TENSOR = [(32, 64, "bfloat16"), (16, 224, "float32")]
GPU_PER_TENSOR = PER_TENSOR + [(8192, 2048, "bfloat16"), (16384, 7168, "bfloat16")]


def run_per_tensor(i: int, case: tuple, dev: str) -> dict:
    """per_tensor(one_pass=True) against the reference (formats.nvfp4.quantize, scope "tensor") and the two-kernel
    per_tensor, byte for byte."""
    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_nvfp4 as knv

    m, k, dtype = case
    x = _input(m, m, 1, k, dtype, "", 500 + i, dev)
    d, sc, sd, g = knv.per_tensor(x, one_pass=True)
    d2, sc2, sd2, g2 = knv.per_tensor(x)
    same = lambda a, b: bool(torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)))  # noqa: E731
    out = {"two_kernels.data": same(d, d2), "two_kernels.scale": same(sc, sc2), "two_kernels.sdec": same(sd, sd2),
           "two_kernels.amax": same(g, g2)}
    if m * k <= 1 << 20:  # the readable reference is slow on large tensors
        want = nvfp4.quantize(x.cpu(), scope="tensor")
        out.update({"reference.data": same(d, want.data), "reference.scale": same(sc, want.scale),
                    "reference.sdec": same(sd, want.global_scale.reshape(1))})
    return out


def test_item_kernels_refuse_what_they_cannot_tile():
    from precision_dsl.kernels import triton_segments as ks

    assert ks.item_blocks_for(6, 96) == 0  # 36 blocks a member: no item of >= 16 blocks divides it
    assert ks.item_blocks_for(768, 2048) == 256 and ks.item_blocks_for(2048, 768, 1024) == 1024
    x = torch.zeros(12, 96, dtype=torch.bfloat16)
    o = (torch.empty(12, 48, dtype=torch.uint8), torch.empty(12, 6, dtype=torch.uint8), torch.empty(2))
    with pytest.raises(ValueError, match="does not tile"):
        ks.nvfp4_segment_items(x, 6, 6, *o, torch.zeros(1, dtype=torch.int32), item_blocks=16)
    with pytest.raises(ValueError, match="contiguous"):
        ks.nvfp4_segment_fused(torch.zeros(96, 32, dtype=torch.bfloat16).t(), 32, 32,
                               torch.empty(32, 48, dtype=torch.uint8), torch.empty(32, 6, dtype=torch.uint8),
                               torch.empty(1), torch.zeros(1, dtype=torch.int32), item_blocks=16)


def _interpreted() -> dict:
    return {r["case"]: r["checks"] for r in ki.interpreted_rows(__file__, timeout=900)}


def test_item_kernels_equal_the_row_tile_path_interpreted():
    results = _interpreted()
    assert len(results) == len(CASES) + len(PER_TENSOR)
    bad = ki.failed_checks(results)
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("i", range(len(GPU_PER_TENSOR)))
def test_per_tensor_one_pass_gpu(i):
    checks = run_per_tensor(i, GPU_PER_TENSOR[i], "cuda")
    assert all(checks.values()), checks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("i", range(len(GPU_CASES)))
def test_item_kernels_equal_the_row_tile_path_gpu(i):
    for rep in range(3):  # the programs' interleaving differs run to run: the bytes must not
        checks = run_case(i, GPU_CASES[i], "cuda")
        assert all(checks.values()), (rep, checks)


if __name__ == "__main__":  # the interpreter child
    ki.model_the_hardware()  # the interpreter's fp8 casts, bf16 widening and max as the H200's
    for i, case in enumerate(CASES):
        print(json.dumps({"case": i, "checks": run_case(i, case, "cpu")}), flush=True)
    for i, case in enumerate(PER_TENSOR):
        print(json.dumps({"case": f"per_tensor{i}", "checks": run_per_tensor(i, case, "cpu")}), flush=True)
