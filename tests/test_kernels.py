"""Fused Triton quantize kernels (precision_dsl/kernels) vs the golden vectors and vs the readable references.

Every comparison is exact: data bytes, scale bytes and fp32 scales bit for bit. The kernel tests need a CUDA GPU with
compute capability >= 8.9 (marked `gpu`; run them on the H200 through the device tool) and are skipped elsewhere.
On CPU (CI) the same kernels run under Triton's interpreter: tests/test_kernels_interpret.py, and here
`test_nvfp4_coder_and_edge_inputs_interpreted` (the E2M1 coder, the block-scale reciprocal and edge-case rows,
tests/kernels_e2m1.py; its GPU twins check the coder and the reciprocal on all 2^32 fp32 bit patterns).
Golden vectors: env POLICYC_GOLDEN_DIR (default <repo>/../shared/golden/quantizers).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from precision_dsl.precision import TensorFormat

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(os.environ.get("POLICYC_GOLDEN_DIR", REPO.parent / "shared" / "golden" / "quantizers"))
if not GOLDEN_DIR.is_absolute():
    GOLDEN_DIR = (Path.cwd() / GOLDEN_DIR).resolve()


def _gpu_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from precision_dsl import kernels

    return kernels.available()


_skip_without_gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU with compute capability >= 8.9 and "
                                                            "Triton (run on the H200 via the device tool)")


def needs_gpu(test):
    """@pytest.mark.gpu + skipped without a usable GPU."""
    return pytest.mark.gpu(_skip_without_gpu(test))


def _golden_cases():
    index = GOLDEN_DIR / "index.json"
    if not index.exists():
        return [pytest.param(None, None, marks=pytest.mark.skip(
            reason=f"golden vectors not found at {GOLDEN_DIR} (set POLICYC_GOLDEN_DIR)"))]
    files = json.loads(index.read_text())["files"]
    out = []
    for f in files:
        for v in f["variants"]:
            out.append(pytest.param(f["file"], v, id=f"{f['file'].removesuffix('.safetensors')}::{v}"))
    return out


def _load(file: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: t.cuda() for k, t in load_file(str(GOLDEN_DIR / file)).items()}


def _assert_bytes(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.dtype == torch.float32:
        got, want = got.float().contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    else:
        got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    bad = (got != want)
    n = int(bad.sum())
    if n:
        idx = bad.nonzero()[:5].tolist()
        sample = [(i, int(got[tuple(i)]), int(want[tuple(i)])) for i in idx]
        raise AssertionError(f"{name}: {n} of {want.numel()} values differ, first (index, got, want): {sample}")


def _check_nvfp4(t, variant):
    from precision_dsl import kernels

    x = t["input"]
    tile_2d = variant.startswith("nvfp4_16x16")
    scope = "row" if variant.endswith("perrow") else "tensor"
    checked = 0
    for axis, part in (("row", "rowwise"), ("col", "colwise")):
        if f"{variant}.{part}.data" not in t:
            continue
        q = kernels.nvfp4_quantize(x, axis=axis, scope=scope, tile_2d=tile_2d)
        assert q.data.is_cuda, "the kernel path was not taken"
        _assert_bytes(f"{variant}.{part}.data", q.data, t[f"{variant}.{part}.data"])
        _assert_bytes(f"{variant}.{part}.scale", q.scale, t[f"{variant}.{part}.scale"])
        _assert_bytes(f"{variant}.{part}.amax", q.global_amax, t[f"{variant}.{part}.amax"])
        _assert_bytes(f"{variant}.{part}.global_decode_scale", q.global_scale,
                      t[f"{variant}.{part}.global_decode_scale"])
        if scope == "tensor":  # the share-scale path: G given instead of computed
            q2 = kernels.nvfp4_quantize(x, axis=axis, scope="group", tile_2d=tile_2d,
                                        global_amax=t[f"{variant}.{part}.amax"])
            _assert_bytes(f"{variant}.{part}.data (given amax)", q2.data, t[f"{variant}.{part}.data"])
            _assert_bytes(f"{variant}.{part}.scale (given amax)", q2.scale, t[f"{variant}.{part}.scale"])
        checked += 1
    assert checked


def _check_mxfp8(t, variant):
    from precision_dsl import kernels

    x = t["input"]
    _, element, block = variant.split("_")
    if block == "32x32":
        pytest.skip("MXFP8 32x32 tiles have no fused kernel (the dispatcher answers with the reference)")
    axis = "row" if block == "1x32" else "col"
    q = kernels.mxfp8_quantize(x, element, axis=axis)
    assert q.data.is_cuda
    _assert_bytes(f"{variant}.data", q.data, t[f"{variant}.data"])
    _assert_bytes(f"{variant}.scale", q.scale, t[f"{variant}.scale"])
    if x.shape[0] % 32 == 0:  # the fused one-read kernel must give both copies identically
        row, col = kernels.mxfp8_quantize_rowcol(x, element)
        both = row if axis == "row" else col
        _assert_bytes(f"{variant}.data (rowcol)", both.data, t[f"{variant}.data"])
        _assert_bytes(f"{variant}.scale (rowcol)", both.scale, t[f"{variant}.scale"])


def _check_fp8block(t, variant):
    from precision_dsl import kernels

    x = t["input"]
    _, element, block, scl = variant.split("_")
    blk = (1, 128) if block == "1x128" else (128, 128)
    for axis, part in (("row", "rowwise"), ("col", "colwise")):
        q = kernels.fp8_block_quantize(x, element, blk, pow2=scl == "pow2", axis=axis)
        assert q.data.is_cuda
        _assert_bytes(f"{variant}.{part}.data", q.data, t[f"{variant}.{part}.data"])
        _assert_bytes(f"{variant}.{part}.scale_inv", q.scale, t[f"{variant}.{part}.scale_inv"])


@needs_gpu
@pytest.mark.parametrize("file,variant", _golden_cases())
def test_kernel_matches_golden(file, variant):
    t = _load(file)
    fmt = file.split("__")[0]
    {"nvfp4": _check_nvfp4, "mxfp8": _check_mxfp8, "fp8block": _check_fp8block}[fmt](t, variant)


# ------------------------------------------------------------------ random tensors of real shapes vs the reference

REAL_SHAPES = [(8192, 2048), (4096, 4096), (2048, 7168), (7168, 256), (96, 5120), (1, 64), (3, 2, 160)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda") * 3
    flat = x.view(-1, shape[-1])
    # heavy-tailed rows, tiny rows, an all-zero row, exact ties and negative zeros: the edge cases in bulk
    flat[::7] *= torch.exp(torch.randn(flat[::7].shape[0], 1, generator=g, device="cuda") * 8)
    if flat.shape[0] > 3:
        flat[1] *= 1e-30
        flat[2] = 0
        flat[3, ::5] = -0.0
    return x.to(dtype)


def _eq_q(name, got, want):
    for role, w in want.tensors().items():
        _assert_bytes(f"{name}.{role}", got.tensors()[role], w)
    if want.global_amax is not None:
        _assert_bytes(f"{name}.global_amax", got.global_amax, want.global_amax)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=str)
def test_nvfp4_random_matches_reference(shape, dtype):
    from precision_dsl import kernels
    from precision_dsl.formats import nvfp4

    x = _rand(shape, dtype, seed=zlib.crc32(repr((shape, dtype)).encode()))
    m = x.numel() // x.shape[-1]
    for scope in ("row", "tensor"):
        _eq_q(f"nvfp4 {scope}", kernels.nvfp4_quantize(x, scope=scope), nvfp4.quantize(x, scope=scope))
    if m % 16 == 0:
        _eq_q("nvfp4 16x16", kernels.nvfp4_quantize(x, tile_2d=True), nvfp4.quantize(x, tile_2d=True))
        _eq_q("nvfp4 col row-scope", kernels.nvfp4_quantize(x, axis="col", scope="row"),
              nvfp4.quantize(x, axis="col", scope="row"))
    # share-scale group: G = max over two members, given to both
    other = _rand(shape, dtype, seed=7) * 2
    g = nvfp4.group_amax([x, other])
    _eq_q("nvfp4 group", kernels.nvfp4_quantize(x, scope="group", global_amax=g),
          nvfp4.quantize(x, scope="group", global_amax=g))


@needs_gpu
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [s for s in REAL_SHAPES if s[-1] % 32 == 0], ids=str)
def test_mxfp8_random_matches_reference(shape, dtype, element):
    from precision_dsl import kernels
    from precision_dsl.formats import mxfp8

    x = _rand(shape, dtype, seed=zlib.crc32(repr((shape, dtype, element)).encode()))
    m = x.numel() // x.shape[-1]
    _eq_q("mxfp8 row", kernels.mxfp8_quantize(x, element, axis="row"), mxfp8.quantize(x, element, axis="row"))
    if m % 32 == 0:
        row, col = kernels.mxfp8_quantize_rowcol(x, element)
        _eq_q("mxfp8 rowcol/row", row, mxfp8.quantize(x, element, axis="row"))
        _eq_q("mxfp8 rowcol/col", col, mxfp8.quantize(x, element, axis="col"))


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", REAL_SHAPES + [(300, 200)], ids=str)
def test_fp8_block_random_matches_reference(shape, dtype):
    from precision_dsl import kernels
    from precision_dsl.formats import fp8_block

    x = _rand(shape, dtype, seed=zlib.crc32(repr((shape, dtype)).encode()))
    for element, block, pow2 in (("e4m3", (1, 128), True), ("e4m3", (1, 128), False), ("e4m3", (128, 128), True),
                                 ("e4m3", (128, 128), False), ("e5m2", (1, 128), True)):
        for axis in ("row", "col"):
            _eq_q(f"fp8_block {element} {block} pow2={pow2} {axis}",
                  kernels.fp8_block_quantize(x, element, block, pow2, axis=axis),
                  fp8_block.quantize(x, element, block, pow2, axis=axis))


FP8_PAD_SHAPES = [(m, k) for m in (1, 100, 128, 300, 1000, 4097) for k in (128, 200, 384, 1024)] + [(8191, 2048)]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", FP8_PAD_SHAPES, ids=str)
def test_fp8_block_padded_col_and_rowcol_match_reference(shape, dtype):
    """The fp8 backward's copies on CUDA vs the reference on CPU (tests/kernels_interpreted.fp8_pad_rowcol_checks,
    which test_kernels_interpret.py runs interpreted): fp8_block_quantize(x, axis="col", pad_rows_to=128) ==
    quantize(torch.cat([x, zeros])) and fp8_block_quantize_rowcol(x) == (row of x, padded col) byte for byte,
    padded columns = zero bytes; e4m3/e5m2, pow2/fp32 scales; edge rows incl. +-Inf and NaN (max.f32 ignores it)."""
    import kernels_interpreted as ki

    x = ki.fp8_edge_input(*shape, dtype, seed=zlib.crc32(repr((shape, dtype)).encode()), nan=True).cuda()
    bad = {}
    for element in ("e4m3", "e5m2"):
        for pow2 in (True, False):
            checks = ki.fp8_pad_rowcol_checks(x, element, pow2, extra=shape[0] in (100, 300))
            bad.update({f"{element} pow2={pow2} {k}": ok for k, ok in checks.items() if not ok})
            assert len(checks) >= 27
    if shape[0] == 300:
        for pad in (1, 256):
            bad.update({f"pad_rows_to={pad} {k}": ok for k, ok in ki.fp8_pad_rowcol_checks(x, "e4m3", True, pad,
                                                                                         extra=True).items()
                        if not ok})
    assert not bad, f"padded / row+col FP8 block kernels differ from the reference: {sorted(bad)}"


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_tuning_config_gives_the_same_bytes(dtype):
    """The benchmark's sweep picks launch configs; every one of them must give the reference bytes (a config is
    only a different tiling of the same per-block arithmetic)."""
    from precision_dsl.formats import mxfp8, nvfp4
    from precision_dsl.kernels import triton_mxfp8 as kmx
    from precision_dsl.kernels import triton_nvfp4 as knv

    x = _rand((256, 1536), dtype, seed=11)
    ref_row = nvfp4.quantize(x, scope="row")
    for cfg in (dict(block_m=1, num_warps=4), dict(block_m=2, num_warps=8), dict(block_m=1, num_warps=2),
                dict(loop_chunk=64, num_warps=2), dict(loop_chunk=128, num_warps=4), dict(chunk=64, num_warps=2),
                dict(chunk=128, num_warps=4), dict(chunk=32, num_warps=1), dict(chunk=16, num_warps=1),
                *knv.ROW_CONFIGS):
        d, s, sd, g = knv.row_scaled(x, **cfg)
        _assert_bytes(f"row_scaled {cfg} data", d, ref_row.data)
        _assert_bytes(f"row_scaled {cfg} scale", s, ref_row.scale)
        _assert_bytes(f"row_scaled {cfg} S_dec", sd, ref_row.global_scale)
    ref_t = nvfp4.quantize(x, scope="tensor")
    for cfg in (dict(block_m=16, block_nb=16, num_warps=4), dict(block_m=8, block_nb=64, num_warps=4),
                dict(block_m=4, block_nb=64, num_warps=2), dict(block_m=8, block_nb=16, num_warps=2),
                *knv.TENSOR_CONFIGS):
        d, s, sd, g = knv.per_tensor(x, **cfg)
        _assert_bytes(f"per_tensor {cfg} data", d, ref_t.data)
        _assert_bytes(f"per_tensor {cfg} scale", s, ref_t.scale)
    ref_2 = nvfp4.quantize(x, scope="tensor", tile_2d=True)
    x_odd = _rand((48, 272), dtype, seed=12)  # 17 blocks a row: the masked (not EVEN) path
    ref_odd = nvfp4.quantize(x_odd, scope="tensor", tile_2d=True)
    for cfg in (dict(block_nb=16, num_warps=4), dict(block_nb=64, num_warps=8), dict(split=2, num_warps=1),
                *knv.TILE2D_CONFIGS):
        d, s, sd, g = knv.per_tensor(x, tile_2d=True, **cfg)
        _assert_bytes(f"2d {cfg} data", d, ref_2.data)
        _assert_bytes(f"2d {cfg} scale", s, ref_2.scale)
        if cfg.get("thread_rows", True):
            d, s, sd, g = knv.per_tensor(x_odd, tile_2d=True, **cfg)
            _assert_bytes(f"2d {cfg} [48, 272] data", d, ref_odd.data)
            _assert_bytes(f"2d {cfg} [48, 272] scale", s, ref_odd.scale)
    r, c = mxfp8.quantize(x, "e4m3", axis="row"), mxfp8.quantize(x, "e4m3", axis="col")
    for cfg in (dict(split_ro=8, nkb=4, num_warps=2), dict(split_ro=8, nkb=16, num_warps=8),
                dict(split_ro=4, nkb=8, num_warps=4), dict(split_ro=16, nkb=8, num_warps=4),
                dict(split_ro=None, group=1, nkb=8, num_warps=4), dict(split_ro=None, group=2, nkb=8, num_warps=8)):
        rd, rs, cd, cs = kmx.quantize_rowcol(x, "e4m3", True, True, **cfg)
        _assert_bytes(f"mxfp8 {cfg} row data", rd, r.data)
        _assert_bytes(f"mxfp8 {cfg} row scale", rs, r.scale)
        _assert_bytes(f"mxfp8 {cfg} col data", cd, c.data)
        _assert_bytes(f"mxfp8 {cfg} col scale", cs, c.scale)


@needs_gpu
def test_dispatch_falls_back_for_uncovered_requests():
    """32x32 MXFP8 tiles and CPU tensors are answered by the reference (same result, no error)."""
    from precision_dsl import kernels
    from precision_dsl.formats import mxfp8

    x = _rand((64, 128), torch.bfloat16, seed=3)
    q = kernels.mxfp8_quantize(x, tile_2d=True)
    _eq_q("mxfp8 32x32", q, mxfp8.quantize(x, tile_2d=True))
    qc = kernels.mxfp8_quantize(x.cpu())
    assert not qc.data.is_cuda


@needs_gpu
@pytest.mark.parametrize("fmt", [
    TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row"),
    TensorFormat(kind="nvfp4", element="e2m1", block=(16, 16), scale_dtype="e4m3", global_scale="tensor"),
    TensorFormat(kind="mxfp8", element="e4m3", block=(1, 32), scale_dtype="e8m0"),
    TensorFormat(kind="fp8_block", element="e4m3", block=(128, 128), scale_dtype="fp32"),
    TensorFormat(kind="fp8_block", element="e4m3", block=(1, 128), scale_dtype="pow2"),
])
@pytest.mark.parametrize("axis", ["row", "col"])
def test_format_generic_entry_point_matches_reference(fmt, axis):
    """kernels.quantize(x, fmt) (used by the engine and the converter on CUDA) == formats.quantize(x, fmt)."""
    from precision_dsl import formats, kernels

    x = (torch.randn(256, 512, device="cuda") * 3).to(torch.bfloat16)
    a, b = kernels.quantize(x, fmt, axis=axis), formats.quantize(x.cpu(), fmt, axis=axis)
    for name, t in b.tensors().items():
        assert torch.equal(a.tensors()[name].cpu().view(torch.uint8), t.view(torch.uint8)), name


def _launches(monkeypatch, call):
    """[(kernel name, grid, constexpr / launch kwargs)] the NVFP4 host wrapper `call(knv)` would launch, recorded on
    meta tensors (no GPU, nothing compiled)."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    sink = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: sink.append((self.name, tuple(grid), kw))

    for name in ("_nvfp4_row_scaled_kernel", "_nvfp4_row_scaled_chunked_kernel", "_nvfp4_row_scaled_loop_kernel",
                 "_nvfp4_tensor_kernel", "_nvfp4_tile2d_rows_kernel", "_amax_flat_kernel", "_amax_kernel"):
        monkeypatch.setattr(knv, name, Rec(name))
    call(knv)
    return sink


def test_nvfp4_default_launch_configs(monkeypatch):
    """The defaults the H200 sweep chose: per-token = 64-block register chunks / 2 warps wherever they divide the
    row in <= 8 chunks (K = 2048 and 7168), else the whole row, one row / 2 warps; 1x16 = 4 rows x 64 blocks /
    2 warps in k_major order; 16x16 = the thread_rows kernel (16 tiles / 2 warps, 4 rows of 16 elements a thread)
    in k_major order, the TILE_2D kernel at 16 tiles / 4 warps in row-major order when asked; k_major swaps the
    grid axes (block columns on axis 0) and is dropped past CUDA's 65535 limit of axis 1."""
    def meta(m, k):
        return torch.empty((m, k), dtype=torch.bfloat16, device="meta")

    g = torch.empty((1,), dtype=torch.float32, device="meta")
    for k, nch in ((2048, 2), (7168, 7), (1024, 1)):
        (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.row_scaled(meta(64, k)))
        assert (name, grid, kw["NCH"], kw["CH"], kw["EVEN"], kw["num_warps"]) == (
            "_nvfp4_row_scaled_chunked_kernel", (64,), nch, 64, True, 2), (k, kw)
    for k, cfg, bm in ((2048, dict(chunk=0), 1), (96, {}, 8), (2048, dict(block_m=2), 2)):
        (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.row_scaled(meta(64, k), **cfg))
        assert (name, kw["BLOCK_M"], kw["num_warps"]) == ("_nvfp4_row_scaled_kernel", bm, 2), (k, cfg, kw)
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4096, 7168), g, tile_2d=True))
    assert (name, grid, kw["BLOCK_NB"], kw["num_warps"], kw["K_MAJOR"], kw["SPLIT"]) == (
        "_nvfp4_tile2d_rows_kernel", (28, 256), 16, 2, True, 4)
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4096, 7168), g, tile_2d=True,
                                                                           thread_rows=False))
    assert (name, grid, kw["BLOCK_M"], kw["BLOCK_NB"], kw["num_warps"], kw["K_MAJOR"]) == (
        "_nvfp4_tensor_kernel", (256, 28), 16, 16, 4, False)
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4096, 7168), g, tile_2d=True,
                                                                           thread_rows=False, k_major=True))
    assert (grid, kw["K_MAJOR"]) == ((28, 256), True)
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4096, 7168), g))
    assert (name, grid, kw["BLOCK_M"], kw["BLOCK_NB"], kw["num_warps"], kw["K_MAJOR"]) == (
        "_nvfp4_tensor_kernel", (7, 1024), 4, 64, 2, True)
    # with its own amax pass the quantize pass walks the tensor from the end (TENSOR_REVERSE); with G given, not
    launches = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4096, 7168)))
    assert [(name, kw.get("REVERSE")) for name, grid, kw in launches] == [("_amax_flat_kernel", None),
                                                                         ("_nvfp4_tensor_kernel", True)]
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4096, 7168), g))
    assert kw["REVERSE"] is False
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4 * 65536, 32), g, k_major=True))
    assert (grid, kw["K_MAJOR"]) == ((65536, 1), False)  # 65536 stripes do not fit axis 1: the default order
    (name, grid, kw), = _launches(monkeypatch, lambda knv: knv.per_tensor(meta(4 * 65535, 32), g, k_major=True))
    assert (grid, kw["K_MAJOR"]) == ((1, 65535), True)


def _recorded_launches(call):
    """[(kernel, grid, positional args, kwargs)] that the NVFP4 host wrapper `call(knv)` would launch on meta
    tensors (benchmarks/sass_count.py's recorder, which also compiles them offline)."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    sink = []
    with _sass_count().recording(knv, sink):
        call(knv)
    return sink


def _sass_count():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass_count", Path(__file__).resolve().parents[1] / "benchmarks"
                                                  / "sass_count.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nvfp4_l2_hints_launch_and_reach_the_ptx(monkeypatch):
    """per_tensor(l2_keep=f): the amax pass marks the programs that read the last f * L2 bytes of x evict_last and
    the others evict_first, the quantize pass loads and stores evict_first; by default (TENSOR_L2_KEEP = 0.5) only
    where the tensor fits in L2 whole (8192x2048 bf16 in 50 MiB: yes; 16384x7168: no), never for 16x16, refused
    outside 0..1. Compiled offline for sm_90 (no GPU), the hints are in the PTX as
    createpolicy + ld/st .L2::cache_hint, a launch without them has none, and the hints cost no registers."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    assert knv.TENSOR_L2_KEEP == 0.5
    monkeypatch.setattr(knv, "l2_cache_bytes", lambda device: 50 << 20)  # the H200's L2 as torch reports it
    x = torch.empty((8192, 2048), dtype=torch.bfloat16, device="meta")
    g = torch.empty((1,), dtype=torch.float32, device="meta")

    def hints(launches):
        return [(fn.__name__, kw["L2_HINTS"], args[3] if fn.__name__ == "_amax_flat_kernel" else None)
                for fn, grid, args, kw in launches]

    # 8M pair words in 512 programs of 16384 words (64 KiB); 25 MiB kept = the last 400 programs
    assert hints(_recorded_launches(lambda k: k.per_tensor(x, l2_keep=0.5))) == [
        ("_amax_flat_kernel", True, 112), ("_nvfp4_tensor_kernel", True, None)]
    assert hints(_recorded_launches(lambda k: k.per_tensor(x, l2_keep=1.0))) == [
        ("_amax_flat_kernel", True, 0), ("_nvfp4_tensor_kernel", True, None)]
    assert hints(_recorded_launches(lambda k: k.per_tensor(x))) == [
        ("_amax_flat_kernel", True, 112), ("_nvfp4_tensor_kernel", True, None)]
    assert hints(_recorded_launches(lambda k: k.per_tensor(x, l2_keep=0))) == [
        ("_amax_flat_kernel", False, 512), ("_nvfp4_tensor_kernel", False, None)]
    big = torch.empty((16384, 7168), dtype=torch.bfloat16, device="meta")  # 224 MiB: no hints by default
    assert hints(_recorded_launches(lambda k: k.per_tensor(big))) == [
        ("_amax_flat_kernel", False, 3584), ("_nvfp4_tensor_kernel", False, None)]
    assert hints(_recorded_launches(lambda k: k.per_tensor(big, l2_keep=0.5)))[1] == ("_nvfp4_tensor_kernel", True, None)
    assert hints(_recorded_launches(lambda k: k.per_tensor(x, g, l2_keep=0.5))) == [
        ("_nvfp4_tensor_kernel", True, None)]
    (fn, grid, args, kw), = _recorded_launches(lambda k: k.per_tensor(x, g, tile_2d=True, l2_keep=0.5))
    assert fn.__name__ == "_nvfp4_tile2d_rows_kernel" and "L2_HINTS" not in kw
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="fraction of the L2"):
            knv.per_tensor(x, l2_keep=bad)

    sc = _sass_count()
    ptx, regs = {}, {}
    for label, call in (("hints", lambda k: k.per_tensor(x, l2_keep=0.5)),
                        ("plain", lambda k: k.per_tensor(x, l2_keep=0))):
        for fn, grid, args, kw in _recorded_launches(call):
            compiled = sc.compile_launch(fn, grid, args, kw)[0]
            ptx[label, fn.__name__] = compiled.asm["ptx"]
            regs[label, fn.__name__] = sc.resources_of(compiled.asm["cubin"])

    def policies(text):  # the opcodes (after any @predicate) of the lines that set or use a cache policy
        return sorted({next(w for w in line.split() if not w.startswith("@")) for line in text.splitlines()
                       if "createpolicy" in line or "cache_hint" in line})

    assert policies(ptx["hints", "_amax_flat_kernel"]) == [
        "createpolicy.fractional.L2::evict_first.b64", "createpolicy.fractional.L2::evict_last.b64",
        "ld.global.L1::evict_first.L2::cache_hint.v4.b32", "ld.global.L1::evict_last.L2::cache_hint.v4.b32"]
    quant = policies(ptx["hints", "_nvfp4_tensor_kernel"])
    assert "createpolicy.fractional.L2::evict_first.b64" in quant
    assert any(p.startswith("ld.global.L1::evict_first.L2::cache_hint") for p in quant)
    assert any(p.startswith("st.global.L1::evict_first.L2::cache_hint") for p in quant)
    assert not any("evict_last" in p for p in quant)
    assert policies(ptx["plain", "_amax_flat_kernel"]) == policies(ptx["plain", "_nvfp4_tensor_kernel"]) == []
    # the hinted amax pass reduces inside each branch: as few registers as the plain one (32: 8 programs an SM),
    # none spilled; a branch yielding the loaded words took 70
    for name in ("_amax_flat_kernel", "_nvfp4_tensor_kernel"):
        assert regs["hints", name][0] <= regs["plain", name][0] and regs["hints", name][1] == 0, (name, regs)


def test_nvfp4_amax_parts_launch_and_ptx():
    """per_tensor(amax_parts=True): the amax kernel stores one partial max per program (no zero-fill, no atomic)
    and the quantize kernel reduces all of them (G_PARTS = the next power of two) and writes G; past
    AMAX_PARTS_MAX programs (16384x7168: 3584) the atomic pass runs; on by default (TENSOR_AMAX_PARTS). Offline
    sm_90: the parts kernel has no atomic and the reducing quantize kernel spills nothing."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    assert knv.TENSOR_AMAX_PARTS is True
    x = torch.empty((8192, 2048), dtype=torch.bfloat16, device="meta")

    def shape(launches):
        return [(fn.__name__, grid, kw.get("PARTS"), kw.get("G_PARTS"),
                 args[11] if fn.__name__ == "_nvfp4_tensor_kernel" else None) for fn, grid, args, kw in launches]

    parts = _recorded_launches(lambda k: k.per_tensor(x, amax_parts=True))
    assert shape(parts) == [("_amax_flat_kernel", (512,), True, None, None),
                            ("_nvfp4_tensor_kernel", (2, 2048), None, 512, 512)]
    assert shape(_recorded_launches(lambda k: k.per_tensor(x))) == shape(parts)
    atomic = _recorded_launches(lambda k: k.per_tensor(x, amax_parts=False))
    assert shape(atomic) == [
        ("_amax_flat_kernel", (512,), None, None, None), ("_nvfp4_tensor_kernel", (2, 2048), None, 0, 0)]
    big = torch.empty((16384, 7168), dtype=torch.bfloat16, device="meta")
    assert [p[2] for p in shape(_recorded_launches(lambda k: k.per_tensor(big, amax_parts=True)))] == [None, None]
    assert [p[3] for p in shape(_recorded_launches(lambda k: k.per_tensor(big, amax_parts=True)))] == [None, 0]

    sc = _sass_count()
    compiled = {fn.__name__: sc.compile_launch(fn, grid, args, kw)[0] for fn, grid, args, kw in parts}
    assert "atom" not in compiled["_amax_flat_kernel"].asm["ptx"]
    assert "atom.global" in sc.compile_launch(*atomic[0])[0].asm["ptx"]
    assert sc.resources_of(compiled["_nvfp4_tensor_kernel"].asm["cubin"])[1] == 0


def test_nvfp4_packed_tensor_launch_and_ptx():
    """per_tensor(packed=True): the 1x16 quantize kernel takes its block amaxes on the packed halves (PACKED),
    with its own amax pass and with G given; off by default (TENSOR_PACKED). Offline sm_90: the PTX has the packed
    max (max.bf16x2 / max.f16x2; the plain kernel has none), and the point of it holds: fewer registers (56 against
    93 at the default tile, bf16 and fp16; 60 against 96 launched with PDL), none spilled, no more than 1% more
    instructions."""
    from precision_dsl.kernels import triton_nvfp4 as knv

    assert knv.TENSOR_PACKED is False
    sc = _sass_count()
    for dtype, op in ((torch.bfloat16, "max.bf16x2"), (torch.float16, "max.f16x2")):
        x = torch.empty((8192, 2048), dtype=dtype, device="meta")
        g = torch.empty((1,), dtype=torch.float32, device="meta")
        flags = [(fn.__name__, kw.get("PACKED")) for fn, grid, args, kw in
                 _recorded_launches(lambda k: k.per_tensor(x, packed=True))]
        assert flags == [("_amax_flat_kernel", None), ("_nvfp4_tensor_kernel", True)]
        assert [kw.get("PACKED") for *_, kw in _recorded_launches(lambda k: k.per_tensor(x))] == [None, False]
        found = {}
        for label, call in (("packed", lambda k: k.per_tensor(x, g, packed=True)),
                            ("plain", lambda k: k.per_tensor(x, g))):
            (fn, grid, args, kw), = _recorded_launches(call)
            compiled = sc.compile_launch(fn, grid, args, kw)[0]
            regs, spilled = sc.resources_of(compiled.asm["cubin"])
            main = sc.summarize(sc.parse_sass(sc.sass_of(compiled.asm["cubin"])))["main"]
            found[label] = (op in compiled.asm["ptx"], regs, spilled, main)
        assert found["packed"][0] and not found["plain"][0], (dtype, found)
        assert found["packed"][1] <= 64 < found["plain"][1], (dtype, found)
        assert found["packed"][2] == found["plain"][2] == 0, (dtype, found)
        assert found["packed"][3] <= 1.01 * found["plain"][3], (dtype, found)
    # as launched on the H200 after its own amax pass (PDL: the tile is held across griddepcontrol.wait)
    pdl = {label: {r["kernel"]: r for r in sc.count("tensorpdl", 8192, 2048, cfg)}
           for label, cfg in (("packed", dict(packed=True)), ("plain", {}))}
    assert pdl["packed"]["_nvfp4_tensor_kernel"]["regs"] <= 64 < pdl["plain"]["_nvfp4_tensor_kernel"]["regs"], pdl
    assert pdl["packed"]["_nvfp4_tensor_kernel"]["local_bytes"] == 0


# ------------------------------------------------------------------ the element coder and the block-scale reciprocal

def test_nvfp4_coder_and_edge_inputs_interpreted():
    """Under Triton's interpreter (CPU): e2m1_word / e2m1_code on every E2M1 tie and grid point with its fp32
    neighbours, zeros, subnormals, saturation and inf == the reference coder; rcp_rn == div_rn; row-scaled NVFP4
    (whole row, register chunks incl. K = 7168's 7 x 64 blocks, multi-row tiles), per-tensor and 16x16 NVFP4 on
    edge-case rows (every tie at amax 6, subnormals, signed zeros, saturation), bf16 and fp32, byte for byte
    (tests/kernels_e2m1.py)."""
    import kernels_e2m1 as ke
    import kernels_interpreted as ki

    results = {r["case"]: r["checks"] for r in ki.interpreted_rows(ke.__file__)}
    assert len(results) == 2 + 2 * len(ke.ROW_CASES), sorted(results)
    assert results["e2m1_word"] and all(len(c) >= 1 for c in results.values())
    bad = ki.failed_checks(results)
    assert not bad, f"interpreted NVFP4 coder / kernels differ from the reference: {bad}"


@needs_gpu
def test_e2m1_word_and_code_match_the_reference_on_every_fp32():
    """Every one of the 2^32 fp32 bit patterns (NaN, inf, subnormals, both zeros included) through the compiled
    e2m1_word and e2m1_code gives the reference coder's code."""
    import kernels_e2m1 as ke

    step = 1 << 28
    for start in range(-(1 << 31), 1 << 31, step):
        y = torch.arange(start, start + step, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        word, code = ke.e2m1_probe(y)
        want = ke.reference_codes(y)
        for name, got in (("e2m1_word", word), ("e2m1_code", code)):
            bad = (got != want).nonzero()
            assert bad.numel() == 0, (f"{name} differs from the reference at {bad.numel()} patterns, e.g. "
                                      f"{hex(int(y[bad[0]].view(torch.int32)) & 0xFFFFFFFF)}")


@needs_gpu
def test_rcp_rn_equals_the_ieee_division_on_every_fp32():
    """rcp.rn.f32 (the block-scale reciprocal) == div.rn.f32 1/x bit for bit on all 2^32 inputs (subnormal
    operands and results, zeros, inf; NaN in, NaN out)."""
    import kernels_e2m1 as ke

    step = 1 << 28
    for start in range(-(1 << 31), 1 << 31, step):
        x = torch.arange(start, start + step, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        r, d = ke.rcp_probe(x)
        same = (r.view(torch.int32) == d.view(torch.int32)) | (torch.isnan(r) & torch.isnan(d))
        bad = (~same).nonzero()
        assert bad.numel() == 0, f"rcp_rn != div_rn at {bad.numel()} inputs, e.g. {float(x[bad[0]])}"


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nvfp4_row_packed_block_max_meets_nan_and_inf_like_the_fp32_max(dtype):
    """max.bf16x2 / max.f16x2 compiled (the packed block max of row_scaled): +-inf, NaN beside finite values, an
    all-NaN block and an all-NaN row give the bytes of the fp32 max.f32 path, at K = 7168 / 2048 / 224 and every
    chunk size the wrapper takes."""
    import kernels_interpreted as ki

    from precision_dsl.kernels import triton_nvfp4 as knv

    for k, chunks in ((7168, (64, 128)), (2048, (64, 32)), (224, (4, 16))):
        x = ki.nvfp4_non_finite_rows(dtype, seed=k, k=k).cuda()
        for chunk in chunks:
            got = knv.row_scaled(x, chunk=chunk, packed=True)
            want = knv.row_scaled(x, chunk=chunk, packed=False)
            for name, g, w in zip(("data", "scale", "S_dec", "amax"), got, want):
                _assert_bytes(f"K={k} chunk={chunk} {name}", g, w)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nvfp4_tensor_packed_block_max_meets_nan_and_inf_like_the_fp32_max(dtype):
    """The packed block max of per_tensor (PACKED of _nvfp4_tensor_kernel) compiled, with PDL after its own amax
    pass and with a finite G given: +-inf, NaN beside finite values, an all-NaN block and an all-NaN row give the
    bytes of the fp32 max.f32 path, at K = 7168 / 2048 / 224, default and 8-row tiles; bf16 subnormal blocks give
    the reference's bytes."""
    import kernels_interpreted as ki

    from precision_dsl.kernels import triton_nvfp4 as knv

    for k in (7168, 2048, 224):
        x = ki.nvfp4_non_finite_rows(dtype, seed=k, k=k).cuda()
        finite_g = x.float().nan_to_num(0.0, 0.0, 0.0).abs().amax().reshape(1) / 4
        for g in (None, finite_g):
            for cfg in ({}, dict(block_m=8)):
                got = knv.per_tensor(x, g, packed=True, **cfg)
                want = knv.per_tensor(x, g, packed=False, **cfg)
                for name, a, b in zip(("data", "scale", "S_dec", "G"), got, want):
                    _assert_bytes(f"K={k} G={'given' if g is not None else 'own'} {cfg} {name}", a, b)
    if dtype == torch.bfloat16:  # blocks of bf16 subnormals only (max.bf16x2 keeps them) against the reference
        from precision_dsl.formats import nvfp4

        xs = ki.subnormal_input(*ki.SUBNORMAL_SHAPE, seed=131)
        ref = nvfp4.quantize(xs, scope="tensor")
        d, s, sd, g = knv.per_tensor(xs.cuda(), packed=True)
        for name, a, b in (("data", d, ref.data), ("scale", s, ref.scale), ("G", g, ref.global_amax)):
            _assert_bytes(f"subnormal {name}", a.cpu(), b)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nvfp4_edge_inputs_every_launch_config(dtype):
    """The interpreted edge-case check, compiled: ties, subnormals, signed zeros, saturation, K = 7168, every
    per-row launch config of the benchmark's sweep."""
    import kernels_e2m1 as ke

    from precision_dsl.kernels import triton_nvfp4 as knv

    for (m, k), cfgs in ke.ROW_CASES + [((64, 7168), knv.ROW_CONFIGS), ((64, 2048), knv.ROW_CONFIGS)]:
        x = ke.edge_input(m, k, dtype, seed=m * 7 + k).cuda()
        checks = ke.kernel_checks(x, cfgs)
        bad = [c for c, ok in checks.items() if not ok]
        assert checks and not bad, f"{m}x{k}: {bad}"
