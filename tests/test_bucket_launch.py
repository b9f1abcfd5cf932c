"""Bucket launches (precision_dsl/kernels/triton_bucket.py: every NVFP4 / MXFP8 segment of a weight-update bucket in
one launch) give exactly the bytes of the one-segment kernels they replace, written at each segment's offsets in
one bucket buffer, and nothing outside them.

NVFP4 (`NVFP4BucketLaunch`, the predicted kernel + one redo + the roll): segments of different K, rows per member
and share-scale groups, separate input tensors; three updates - the first (no amax known), the same weights again
(every prediction right), one group's amax changed in one segment - each against the two-pass row-tile kernels
(seg_amax + nvfp4_segment) on that segment alone, and the kept amaxes against the true ones; NaN/Inf counted;
more segments than one launch takes (chunked launches); unaligned inputs (no vector hints). MXFP8
(`MXFP8BucketLaunch`): inputs of different shapes against triton_mxfp8.quantize_rows_flat each, a block count
that is not a multiple of the item (masked), the NaN/Inf count. On CPU under Triton's interpreter (child process,
hardware model), on CUDA compiled (marked gpu).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_interpreted as ki  # noqa: E402

import triton  # noqa: F401  (in the test extra: a missing interpreter fails, never skips)

# NVFP4 segments: (rows_per_member, rows_per_group, members, K); item blocks 16 in the interpreter
NV_SEGMENTS = [(4, 4, 8, 128), (16, 16, 3, 32), (8, 8, 2, 256), (8, 16, 4, 64)]
GPU_NV_SEGMENTS = [(512, 1024, 16, 1024), (1024, 1024, 8, 512), (768, 1536, 8, 2048), (64, 128, 4, 512)]
# MXFP8 inputs [M, K]; (40, 96) has 120 blocks: not a multiple of the 64-block item
MX_INPUTS = [(32, 64), (40, 96), (64, 128), (16, 32)]
GPU_MX_INPUTS = [(4096, 2048), (512, 2048), (40, 96), (2048, 4096)]


def _x(m, k, seed, dev, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 0.05
    x[::5] *= torch.exp(torch.randn(x[::5].shape[0], 1, generator=g) * 2)
    x[1] = 0.0
    return x.to(dtype).to(dev)


def _same(a, b) -> bool:
    return bool(torch.equal(a.cpu().contiguous().view(torch.uint8).reshape(-1),
                            b.cpu().contiguous().view(torch.uint8).reshape(-1)))


def _nv_layout(shapes, offset_pad):
    """Byte offsets (data, scale, S_dec, input_scale) of each segment in one bucket, 256-aligned plus offset_pad."""
    off, lay = 0, []
    for rpm, rpg, n, k in shapes:
        m = rpm * n
        parts = []
        for nb in (m * k // 2, m * k // 16, 4 * n, 4 * n):
            parts.append(off + offset_pad)
            off += -(-(nb + offset_pad) // 256) * 256
        lay.append(parts)
    return lay, off


def run_nvfp4(shapes, dev, item_blocks, max_segments, unaligned=False, solo_bytes=1 << 40) -> dict:
    from precision_dsl.kernels import triton_bucket as kb
    from precision_dsl.kernels import triton_segments as ks

    pad = 4 if unaligned else 0
    lay, total = _nv_layout(shapes, pad)
    xs = []
    for i, (rpm, rpg, n, k) in enumerate(shapes):
        x = _x(rpm * n, k, 10 + i, dev)
        if unaligned:  # the input 4 bytes past a 16-byte boundary: the launch must drop its vector hints
            x = torch.cat([torch.zeros(2, dtype=x.dtype, device=dev), x.reshape(-1)])[2:].view(rpm * n, k)
        xs.append(x)
    entries = [(x, rpg, rpm, *lay[i]) for i, (x, (rpm, rpg, n, k)) in enumerate(zip(xs, shapes))]
    launch = kb.NVFP4BucketLaunch(entries, item_blocks, dev, max_segments=max_segments, solo_bytes=solo_bytes)
    n_solo = sum(x.numel() * x.element_size() >= solo_bytes for x in xs)
    checks = {"aligned_flag": launch.aligned == (not unaligned or n_solo == len(xs)),
              "solo": len(launch.solo) == n_solo,
              "chunks": len(launch.tables) == -(-(len(shapes) - n_solo) // max_segments)}
    buf = torch.full((total,), 0xAA, dtype=torch.uint8, device=dev)
    untouched = torch.ones(total, dtype=torch.bool)
    for (rpm, rpg, n, k), (d, s, sd, isc) in zip(shapes, lay):
        m = rpm * n
        for o, nb in ((d, m * k // 2), (s, m * k // 16), (sd, 4 * n), (isc, 4 * n)):
            untouched[o:o + nb] = False

    def want(x, rpm, rpg):
        m, k = x.shape
        bits = torch.zeros(m // rpg, dtype=torch.int32, device=dev)
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
        data = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
        scale = torch.empty(m, k // 16, dtype=torch.uint8, device=dev)
        sdec = torch.empty(m // rpm, device=dev)
        ks.seg_amax(x, rpg, bits, bad)
        ks.nvfp4_segment(x, bits.view(torch.float32), rpg, rpm, data, scale, sdec)
        return bits, data, scale, sdec

    for step in ("first", "same", "changed"):
        if step == "changed":  # segment 1's group 0 amax moves, every other group's does not
            x = xs[1]
            rpg = shapes[1][1]
            x[0, 0] = x[:rpg].float().abs().max() * 2
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
        launch.launch(buf, bad)
        for i, ((rpm, rpg, n, k), (d, s, sd, isc)) in enumerate(zip(shapes, lay)):
            g0 = launch.first_group[i]
            m = rpm * n
            bits, data, scale, sdec = want(xs[i], rpm, rpg)
            got = lambda o, nb: buf[o:o + nb]  # noqa: E731
            checks[f"{step}.seg{i}.data"] = _same(got(d, m * k // 2), data)
            checks[f"{step}.seg{i}.scale"] = _same(got(s, m * k // 16), scale)
            checks[f"{step}.seg{i}.sdec"] = _same(got(sd, 4 * n), sdec)
            checks[f"{step}.seg{i}.input_scale"] = bool((got(isc, 4 * n).view(torch.float32) == 1).all())
            checks[f"{step}.seg{i}.kept_amax"] = _same(launch.prev_bits[g0:g0 + m // rpg], bits)
        checks[f"{step}.accumulators_zeroed"] = bool((launch.bits == 0).all())
        checks[f"{step}.bad"] = int(bad.item()) == 0
        checks[f"{step}.outside_untouched"] = bool((buf.cpu()[untouched] == 0xAA).all())
    xs[0][3, 5] = float("nan")
    xs[2][0, 0] = float("inf")
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    launch.launch(buf, bad)
    checks["nonfinite.counted"] = int(bad.item()) == 2
    return checks


def run_mxfp8(shapes, dev, max_segments, solo_bytes=1 << 40) -> dict:
    from precision_dsl.kernels import triton_bucket as kb
    from precision_dsl.kernels import triton_mxfp8

    xs = [_x(m, k, 40 + i, dev) for i, (m, k) in enumerate(shapes)]
    off, lay = 0, []
    for m, k in shapes:
        lay.append((off, off + -(-(m * k) // 256) * 256))
        off = lay[-1][1] + -(-(m * k // 32) // 256) * 256
    buf = torch.full((off,), 0xAA, dtype=torch.uint8, device=dev)
    launch = kb.MXFP8BucketLaunch([(x, d, s) for x, (d, s) in zip(xs, lay)], dev, max_segments=max_segments,
                                  solo_bytes=solo_bytes)
    grouped = [(m, k) for m, k in shapes if m * k * 2 < solo_bytes]
    checks = {"even_flag": launch.even == all(m * k // 32 % 64 == 0 for m, k in grouped),
              "solo": len(launch.solo) == len(shapes) - len(grouped)}
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    launch.launch(buf, bad)
    for i, (x, (m, k), (d, s)) in enumerate(zip(xs, shapes, lay)):
        data = torch.empty(m, k, dtype=torch.uint8, device=dev)
        scale = torch.empty(m, k // 32, dtype=torch.uint8, device=dev)
        triton_mxfp8.quantize_rows_flat(x, data, scale)
        checks[f"in{i}.data"] = _same(buf[d:d + m * k], data)
        checks[f"in{i}.scale"] = _same(buf[s:s + m * k // 32], scale)
    checks["bad"] = int(bad.item()) == 0
    xs[1][2, 3] = float("-inf")
    bad.zero_()
    launch.launch(buf, bad)
    checks["nonfinite.counted"] = int(bad.item()) == 1
    return checks


# solo: which inputs keep a launch of their own (kernels/triton_bucket.SOLO_BYTES): "none", "some" (the larger
# ones, interleaved with grouped ones: segments 0, 2 of NV_SEGMENTS and of GPU_NV_SEGMENTS, inputs 0, 2 of the GPU
# MXFP8 shapes), "all"
SOLO = {"none": (1 << 40, 1 << 40), "some": (8192, 10 << 20), "all": (0, 0)}  # (interpreted, GPU) solo_bytes
CASES = [("nvfp4", dict(item_blocks=16, max_segments=32)), ("nvfp4", dict(item_blocks=16, max_segments=3)),
         ("nvfp4", dict(item_blocks=16, max_segments=32, unaligned=True)),
         ("nvfp4", dict(item_blocks=16, max_segments=32, solo="some")),
         ("nvfp4", dict(item_blocks=16, max_segments=32, solo="all")),
         ("mxfp8", dict(max_segments=32)), ("mxfp8", dict(max_segments=2)),
         ("mxfp8", dict(max_segments=32, solo="some"))]


def run(i: int, dev: str, gpu: bool) -> dict:
    kind, kw = CASES[i]
    kw = dict(kw, solo_bytes=SOLO[kw.get("solo", "none")][gpu])
    kw.pop("solo", None)
    if kind == "nvfp4":
        kw = dict(kw, item_blocks=256 if gpu else kw["item_blocks"])
        shapes = GPU_NV_SEGMENTS if gpu and not kw.get("unaligned") else NV_SEGMENTS
        if gpu and kw.get("unaligned"):
            kw["item_blocks"] = 16
        return run_nvfp4(shapes, dev, **kw)
    if not gpu and kw["solo_bytes"] == 8192:
        kw["solo_bytes"] = 16 << 10  # MX_INPUTS 2 (64 x 128 bf16) alone
    return run_mxfp8(GPU_MX_INPUTS if gpu else MX_INPUTS, dev, **kw)


def test_bucket_launch_refuses_what_it_cannot_tile():
    from precision_dsl.kernels import triton_bucket as kb

    x = torch.zeros(12, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        kb.NVFP4BucketLaunch([(x, 6, 6, 0, 1024, 2048, 2304)], 16, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        kb.MXFP8BucketLaunch([(torch.zeros(4, 48, dtype=torch.bfloat16), 0, 256)], "cpu")
    with pytest.raises(ValueError, match="at least one"):
        kb.MXFP8BucketLaunch([], "cpu")


def test_bucket_launches_equal_the_segment_kernels_interpreted():
    results = {r["case"]: r["checks"] for r in ki.interpreted_rows(__file__, timeout=900)}
    assert len(results) == len(CASES)
    bad = ki.failed_checks(results)
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("i", range(len(CASES)))
def test_bucket_launches_equal_the_segment_kernels_gpu(i):
    for rep in range(2):
        checks = run(i, "cuda", gpu=True)
        assert all(checks.values()), (rep, [n for n, ok in checks.items() if not ok])


def test_predicted_kernel_register_cap(monkeypatch):
    """The predicted NVFP4 kernel is launched with ptx maxnreg 96 (10 programs an SM; session 20's H200 update
    figures); None turns the cap off. The interpreted bucket cases above run with it (the interpreter drops it)."""
    from precision_dsl.kernels import triton_segments as ks

    assert ks.PREDICTED_MAXNREG == 96 and ks.predicted_opts() == {"maxnreg": 96}
    monkeypatch.setattr(ks, "PREDICTED_MAXNREG", None)
    assert ks.predicted_opts() == {}


if __name__ == "__main__":  # the interpreter child
    ki.model_the_hardware()
    for i in range(len(CASES)):
        print(json.dumps({"case": i, "checks": run(i, "cpu", gpu=False)}), flush=True)

