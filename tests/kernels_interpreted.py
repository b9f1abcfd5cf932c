"""Run the fused Triton kernels on CPU under Triton's interpreter and compare them with the TE golden vectors.

    TRITON_INTERPRET=1 python tests/kernels_interpreted.py [MAX_ELEMENTS [KIND]]   # one JSON result per case

Driven by tests/test_kernels_interpret.py in a fresh process: triton decides compiled vs interpreted when a kernel
is decorated, so the environment variable must be set before the kernel modules are imported.

Triton 3.6's interpreter models the GPU with numpy; in two places its model is not the hardware's and the check
gives it the hardware's rule: the bf16 -> fp32 widening of subnormals (`exact_bf16_widening`) and the fp32 -> fp8
cast. The kernels use `.to(tl.float8e4nv / tl.float8e5)`, which on sm_89+ is `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`
(round to nearest even, finite overflow and +-inf clamp to +-Fmax, NaN -> 0x7F); the interpreter's `_convert_float` instead rounds on the single cut-off bit with no ties-to-even, no
carry into the exponent and no saturation (about 20 % of MXFP8 bytes come out one code off). `exact_fp8_cast`
replaces that builder method with the PTX rule (clamp, then torch's RNE cast). Everything else -- loads, bit
manipulation, block maxima, E8M0 / E2M1 / E4M3-scale arithmetic, division, packing, stores -- is the kernels' own
code run by the interpreter, and every output byte is compared.

    TRITON_INTERPRET=1 python tests/kernels_interpreted.py subnormal        # bf16 subnormal tiles, every kernel
    TRITON_INTERPRET=1 python tests/kernels_interpreted.py fp8_pad_rowcol   # the padded / row+col FP8 block cases

runs the FP8 block copies of the fp8 backward instead (random inputs with edge rows, no golden vectors): the
columnwise 1x128 copy of x zero-padded to a multiple of 128 rows (`fp8_block_quantize(..., pad_rows_to=128)`) and
both 1x128 copies from one read (`fp8_block_quantize_rowcol`), each against the reference quantization of
`torch.cat([x, zeros])` / of x. tests/test_kernels.py runs the same checks (`fp8_pad_rowcol_checks`) on the GPU.

    TRITON_INTERPRET=1 python tests/kernels_interpreted.py nvfp4_segments   # the weight update's NVFP4 kernels

runs the grouped NVFP4 kernels of the live weight update (triton_segments: per-group amax with the non-finite
count, then every member quantized in one launch) against quantizing each member alone with the reference, and the
per-row NVFP4 kernel variants the golden shapes do not reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(os.environ.get("POLICYC_GOLDEN_DIR", REPO.parent / "shared" / "golden" / "quantizers"))
# Cases whose block maxima see NaN: the interpreter's reductions use numpy's NaN-propagating max, the GPU's
# max.f32 ignores NaN (the kernels rely on it), so their scales cannot be compared here.
NAN_INPUTS = ("nan_inf",)


def exact_fp8_cast() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    from precision_dsl.precision import FP8_MAX

    fp8 = {tl.float8e4nv: (torch.float8_e4m3fn, FP8_MAX["e4m3"]), tl.float8e5: (torch.float8_e5m2, FP8_MAX["e5m2"])}
    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst = dst_type.scalar
        if dst not in fp8 or src.dtype.scalar != tl.float32:
            return original(self, src, dst_type, rounding_mode)
        torch_dtype, fmax = fp8[dst]
        x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        y = x.clamp(-fmax, fmax).to(torch_dtype).view(torch.uint8)
        y[torch.isnan(x)] = 0x7F
        return interpreter.TensorHandle(y.numpy().reshape(src.data.shape), dst)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def exact_bf16_widening() -> None:
    """The interpreter's departure from the hardware on bf16 subnormals: the kernels load bf16 and widen it with
    `.to(tl.float32)`, which on the GPU is exact (`cvt.f32.bf16`: the bf16 bits shifted left by 16; no .ftz, so a
    subnormal stays the same subnormal fp32 value). Triton 3.6's interpreter widens with `_convert_float`
    (triton/runtime/interpreter.py, `InterpreterBuilder.cast_impl`), which normalizes a subnormal significand,
    drops its leading bit, then clamps the (same-bias) fp32 exponent to 0: the value comes out as a different
    fp32 subnormal (every power of two, 2^-133 .. 2^-127, -> 0; 3 * 2^-130 -> 2^-127). A block of bf16 subnormals then gets the
    reference's E8M0 / FP8 block scale but wrong element codes (MXFP8: 0 instead of 24 / 44). Here the widening is
    the hardware's bit shift; every other cast stays the interpreter's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.bfloat16 or dst_type.scalar != tl.float32:
            return original(self, src, dst_type)
        bits = np.asarray(src.data).astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def nan_ignoring_max() -> None:
    """The interpreter's second departure from the hardware, for the NaN cases of `fp8_pad_rowcol`: `tl.max` /
    `tl.maximum` (propagate_nan=NONE) lower to `maxnumf`, which on the GPU is `max.f32` and returns the non-NaN
    operand; numpy's `np.maximum` (the interpreter's model) propagates NaN. `np.fmax` is the hardware's rule."""
    import numpy as np
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)


def model_the_hardware() -> None:
    """All three patches: the interpreter's fp8 casts, bf16 widening and max as the H200 computes them."""
    exact_fp8_cast()
    exact_bf16_widening()
    nan_ignoring_max()


def interpreted_rows(script, *args: str, timeout: int = 1200, extra_env: dict | None = None) -> list[dict]:
    """Run `script` in a child process under Triton's interpreter (TRITON_INTERPRET=1, no CUDA device; PYTHONPATH
    puts this checkout's precision_dsl first, not whichever copy is installed) and return the JSON lines it prints.
    A child that exits non-zero fails the calling test with the tail of its stderr."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **(extra_env or {})}
    out = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def failed_checks(results: dict) -> dict:
    """{case: [names of its failed checks]} of {case: {check name: ok}}, only the cases with a failure."""
    return {case: [n for n, ok in checks.items() if not ok] for case, checks in results.items()
            if not all(checks.values())}


def _same(got, want) -> bool:
    import torch

    view = torch.int32 if want.dtype == torch.float32 else torch.uint8
    return tuple(got.shape) == tuple(want.shape) and torch.equal(got.to(want.dtype).contiguous().view(view),
                                                                 want.contiguous().view(view))


def run_case(file: str, variant: str) -> dict:
    from safetensors.torch import load_file

    from precision_dsl import kernels

    t = load_file(str(GOLDEN_DIR / file))
    x = t["input"]
    checks: dict[str, bool] = {}
    paths = set()
    if file.startswith("nvfp4"):
        tile_2d, scope = variant.startswith("nvfp4_16x16"), "row" if variant.endswith("perrow") else "tensor"
        for axis, part in (("row", "rowwise"), ("col", "colwise")):
            if f"{variant}.{part}.data" not in t:
                continue
            q = kernels.nvfp4_quantize(x, axis=axis, scope=scope, tile_2d=tile_2d, kernel="triton")
            paths.add(q.kernel)
            for attr, key in (("data", "data"), ("scale", "scale"), ("global_amax", "amax"),
                              ("global_scale", "global_decode_scale")):
                checks[f"{part}.{key}"] = _same(getattr(q, attr), t[f"{variant}.{part}.{key}"])
            if scope == "tensor":  # the share-scale path: the group amax is given instead of computed
                q2 = kernels.nvfp4_quantize(x, axis=axis, scope="group", tile_2d=tile_2d, kernel="triton",
                                            global_amax=t[f"{variant}.{part}.amax"])
                checks[f"{part}.data (given amax)"] = _same(q2.data, t[f"{variant}.{part}.data"])
    elif file.startswith("mxfp8"):
        _, element, block = variant.split("_")
        q = kernels.mxfp8_quantize(x, element, axis="row" if block == "1x32" else "col", kernel="triton")
        paths.add(q.kernel)
        checks["data"] = _same(q.data, t[f"{variant}.data"])
        checks["scale"] = _same(q.scale, t[f"{variant}.scale"])
    else:
        _, element, block, scl = variant.split("_")
        for axis, part in (("row", "rowwise"), ("col", "colwise")):
            q = kernels.fp8_block_quantize(x, element, (1, 128) if block == "1x128" else (128, 128),
                                           pow2=scl == "pow2", axis=axis, kernel="triton")
            paths.add(q.kernel)
            checks[f"{part}.data"] = _same(q.data, t[f"{variant}.{part}.data"])
            checks[f"{part}.scale_inv"] = _same(q.scale, t[f"{variant}.{part}.scale_inv"])
    return {"case": f"{file}::{variant}", "paths": sorted(paths), "checks": checks}


# ---- FP8 block: row-padded columnwise copy and the one-read row+col copies -----------------------------------------
# (M, K): M not a multiple of 128 (and a few that are), K a multiple of 128 or not (partial 1x128 blocks). Every
# (dtype, element, scale) combination runs FP8_PAD_SHAPES; FP8_PAD_MORE_SHAPES and FP8_PAD_BIG run for the combinations
# in FP8_PAD_MORE (the interpreter takes ~1 s per 1000x1024 launch; the GPU test runs them all).
FP8_PAD_SHAPES = [(1, 384), (100, 128), (300, 200)]
FP8_PAD_MORE_SHAPES = [(128, 1024), (300, 384), (1000, 128)]
FP8_PAD_MORE = [("bfloat16", "e4m3", True), ("bfloat16", "e4m3", False), ("float32", "e5m2", False)]
FP8_PAD_BIG = (1000, 1024)


def fp8_edge_input(m: int, k: int, dtype, seed: int, nan: bool = False):
    """Random [m, k] input with the edge rows of the FP8 block contract: heavy-tailed rows, a tiny row (Fmax/amax
    overflows -> the input dtype's max), an all-zero row, negative zeros, a near-saturation row (its elements set
    the column-block maxima: RN(x * scale) lands at or just past Fmax), input-dtype-max values, a +-Inf row and,
    with nan=True, NaN elements (interpreted: only with nan_ignoring_max, numpy's max propagates NaN)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[::7] *= torch.exp(torch.randn(x[::7].shape[0], 1, generator=g) * 8)
    if m > 1:
        x[1] *= 1e-30
    if m > 2:
        x[2] = 0
    if m > 3:
        x[3, ::5] = -0.0
    if m > 4:
        j = torch.arange(k, dtype=torch.float32)
        x[4] = 448.0 * (1 + (j % 17) * 2.0 ** -9) * torch.where(j % 2 == 0, 1.0, -1.0) * 1e3
    if m > 5:
        x[5, :4] = torch.tensor([1.0, -1.0, 1.0, -1.0]) * torch.finfo(dtype).max
    if m > 6:
        x[6, ::3] = float("inf")
        x[6, 1::3] = float("-inf")
    if nan and m > 8:
        x[8, ::4] = float("nan")
        x[min(m - 1, 130), 7] = float("nan")
    if m == 1:
        x[0, ::3] = 0
    return x.to(dtype)


def fp8_pad_rowcol_checks(x, element: str, pow2: bool, pad_rows_to: int = 128, extra: bool = False) -> dict:
    """Every check of the padded columnwise copy and the row+col copies of x on the kernel path (x's device: CUDA,
    or CPU under the interpreter) against the reference of x.cpu() padded with torch.cat. extra: also the padded
    rowwise 1x128 copy, the padded columnwise 128x128 copy and the row+col kernel with BLOCK_C = 256."""
    import torch

    from precision_dsl import kernels
    from precision_dsl.formats import fp8_block

    xc = x.cpu()
    m, k = xc.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    padded = torch.cat([xc, xc.new_zeros(mp - m, k)])
    want_col = fp8_block.quantize(padded, element, (1, 128), pow2, axis="col")
    want_row = fp8_block.quantize(xc, element, (1, 128), pow2, axis="row")
    checks: dict[str, bool] = {}

    def same_q(name, got, want, path):
        checks[f"{name}.path"] = got.kernel == path
        checks[f"{name}.data"] = _same(got.data.cpu(), want.data)
        checks[f"{name}.scale"] = _same(got.scale.cpu(), want.scale)
        checks[f"{name}.meta"] = (tuple(got.shape), got.axis, got.fmt, got.orig_dtype) == \
            (tuple(want.shape), want.axis, want.fmt, want.orig_dtype)

    col = kernels.fp8_block_quantize(x, element, (1, 128), pow2, axis="col", pad_rows_to=pad_rows_to, kernel="triton")
    same_q("col", col, want_col, "triton")
    checks["col.shape_is_padded"] = (tuple(col.shape), tuple(col.data.shape), tuple(col.scale.shape)) == \
        ((mp, k), (k, mp), (k, -(-mp // 128)))
    checks["col.padding_is_zero_bytes"] = bool((col.data[:, m:] == 0).all())
    same_q("col.reference_path", kernels.fp8_block_quantize(xc, element, (1, 128), pow2, axis="col",
                                                            pad_rows_to=pad_rows_to, kernel="reference"),
           want_col, "reference")
    row, col2 = kernels.fp8_block_quantize_rowcol(x, element, pow2, pad_rows_to=pad_rows_to, kernel="triton")
    same_q("rowcol.row", row, want_row, "triton")
    same_q("rowcol.col", col2, want_col, "triton")
    checks["rowcol.col.padding_is_zero_bytes"] = bool((col2.data[:, m:] == 0).all())
    rrow, rcol = kernels.fp8_block_quantize_rowcol(xc, element, pow2, pad_rows_to=pad_rows_to, kernel="reference")
    same_q("rowcol.reference_path.row", rrow, want_row, "reference")
    same_q("rowcol.reference_path.col", rcol, want_col, "reference")
    from precision_dsl.kernels import triton_fp8_block

    m16 = -(-m // 16) * 16
    if k % 128 == 0:  # the engine's native-FP8 A operands (fastgemm.fp8_rows16 / fp8_rowcol16): rows padded to 16,
        # the scale grid written outer-dim-major (column stride m16) - the same bytes and scale values
        want_row16 = fp8_block.quantize(torch.cat([xc, xc.new_zeros(m16 - m, k)]), element, (1, 128), pow2,
                                        axis="row")

        def a_buffers():
            return (torch.empty(m16, k, dtype=torch.uint8, device=x.device),
                    torch.empty(k // 128, m16, dtype=torch.float32, device=x.device).t())

        d, sc = a_buffers()
        triton_fp8_block.quantize(x.contiguous(), element, pow2=pow2, out=(d, sc), pad_rows_to=16)
        checks["row16.outer_major.data"] = _same(d.cpu(), want_row16.data)
        checks["row16.outer_major.scale"] = _same(sc.cpu().contiguous(), want_row16.scale)
        if mp >= m16:
            d, sc = a_buffers()
            _, _, cd, cs = triton_fp8_block.quantize_rowcol(x.contiguous(), element, pow2, pad_rows_to,
                                                            out_row=(d, sc), row_pad_to=16)
            checks["rowcol16.row.data"] = _same(d.cpu(), want_row16.data)
            checks["rowcol16.row.scale"] = _same(sc.cpu().contiguous(), want_row16.scale)
            checks["rowcol16.col.data"] = _same(cd.cpu(), want_col.data)
            checks["rowcol16.col.scale"] = _same(cs.cpu(), want_col.scale)
    if extra:

        rd, rs, cd, cs = triton_fp8_block.quantize_rowcol(x.contiguous(), element, pow2, pad_rows_to, block_c=256,
                                                          num_warps=4)  # another tiling: the same bytes
        for name, got, want in (("row.data", rd, want_row.data), ("row.scale", rs, want_row.scale),
                                ("col.data", cd, want_col.data), ("col.scale", cs, want_col.scale)):
            checks[f"rowcol.block_c=256.{name}"] = _same(got.cpu(), want)
        for axis, block in (("row", (1, 128)), ("col", (128, 128))):
            name = f"pad.{axis}.{block[0]}x{block[1]}"
            same_q(name, kernels.fp8_block_quantize(x, element, block, pow2, axis=axis, pad_rows_to=pad_rows_to,
                                                    kernel="triton"),
                   fp8_block.quantize(padded, element, block, pow2, axis=axis), "triton")
    return checks


def fp8_pad_rowcol_cases() -> list[tuple[tuple[int, int], str, str, bool, int, bool]]:
    """(shape, dtype name, element, pow2, pad_rows_to, extra) of the interpreted padded / row+col cases."""
    out = []
    for dtype in ("bfloat16", "float32"):
        for element in ("e4m3", "e5m2"):
            for pow2 in (True, False):
                out += [(shape, dtype, element, pow2, 128, shape == (300, 200) and element == "e4m3")
                        for shape in FP8_PAD_SHAPES]
                if (dtype, element, pow2) in FP8_PAD_MORE:
                    out += [(shape, dtype, element, pow2, 128, False) for shape in FP8_PAD_MORE_SHAPES]
    out += [(FP8_PAD_BIG, "bfloat16", "e4m3", True, 128, False), (FP8_PAD_BIG, "float32", "e5m2", False, 128, False)]
    out += [((100, 256), "bfloat16", "e4m3", False, 256, True), ((300, 128), "float32", "e5m2", True, 1, True)]
    # NaN rows (the GPU test's edge input; nan_ignoring_max): bf16 inputs hold torch's negative NaN 0xFFFF, which
    # must still become byte 0x7F, not a signed NaN byte
    out += [((100, 128), "bfloat16", "e4m3", True, 128, True), ((100, 200), "bfloat16", "e5m2", False, 128, True),
            ((100, 128), "float32", "e4m3", False, 128, True)]
    return out


NAN_CASES_FROM = -3  # the last three cases of fp8_pad_rowcol_cases() carry NaN rows


def run_fp8_pad_rowcol() -> None:
    import torch

    nan_ignoring_max()
    cases = fp8_pad_rowcol_cases()
    for i, (shape, dtype, element, pow2, pad, extra) in enumerate(cases):
        t0 = time.perf_counter()
        nan = i >= len(cases) + NAN_CASES_FROM
        x = fp8_edge_input(*shape, getattr(torch, dtype), seed=1000 + i, nan=nan)
        checks = fp8_pad_rowcol_checks(x, element, pow2, pad, extra)
        case = f"fp8_pad_rowcol::{shape[0]}x{shape[1]}_{dtype}_{element}_{'pow2' if pow2 else 'fp32'}_pad{pad}" \
            + ("_nan" if nan else "")
        print(json.dumps({"case": case, "checks": checks, "seconds": round(time.perf_counter() - t0, 2)}),
              flush=True)


# ---- NVFP4: the weight update's segment kernels and the per-row kernel variants ----------------------------------
# Segment (rows_per_member, rows_per_group, members): one member per group, and gate + up of one expert sharing one
# amax (a group of two members). K = 224 is 14 blocks (not a power of two: partial block tiles).
NVFP4_SEGMENTS = [(16, 16, 3), (8, 16, 4)]
NVFP4_SEG_LAUNCH = [dict(), dict(block_m=1, block_nb=8, num_warps=1), dict(block_m=8, block_nb=4, num_warps=4)]
# Per-row variants that the golden shapes do not reach: the register-chunked kernel (block counts that are not a
# power of two), with partial last chunks, and a multi-row whole-row tile. The two-pass loop kernel
# (`loop_chunk`) cannot run interpreted: triton 3.6's interpreter cannot take `range()` over a kernel argument (its
# scalar arguments are 1-element arrays); tests/test_kernels.py runs it on the GPU.
NVFP4_ROW_VARIANTS = [dict(chunk=2), dict(chunk=4), dict(chunk=16), dict(block_m=4, num_warps=1),
                      dict(chunk=4, packed=True), dict(chunk=16, packed=True)]


def nvfp4_input(m: int, k: int, dtype, seed: int):
    """Finite random [m, k] input with heavy-tailed rows, an all-zero row, a tiny row and negative zeros."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[::5] *= torch.exp(torch.randn(x[::5].shape[0], 1, generator=g) * 4)
    x[1] = 0
    x[2] *= 1e-6
    x[3, ::3] = -0.0
    lim = torch.finfo(dtype).max / 4
    return x.clamp(-lim, lim).to(dtype)


def nvfp4_segment_checks(x, rows_per_member: int, rows_per_group: int, launch: dict) -> dict:
    """seg_amax + nvfp4_segment of the stacked members of x against the reference: each group's amax, and each
    member's data / scale / S_dec equal to quantizing that member alone with its group's amax (scope "group"; a
    one-member group is the member's own per-tensor quantization)."""
    import torch

    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_segments as ks

    m, k = x.shape
    bits = torch.zeros(m // rows_per_group, dtype=torch.int32)
    bad = torch.zeros(1, dtype=torch.int32)
    ks.seg_amax(x, rows_per_group, bits, bad)
    g = bits.view(torch.float32)
    data = torch.empty(m, k // 2, dtype=torch.uint8)
    scale = torch.empty(m, k // 16, dtype=torch.uint8)
    sdec = torch.empty(m // rows_per_member, dtype=torch.float32)
    ks.nvfp4_segment(x, g, rows_per_group, rows_per_member, data, scale, sdec, **launch)
    checks = {"non_finite_count": int(bad.item()) == 0}
    want_g = [nvfp4.group_amax([x[i * rows_per_group:(i + 1) * rows_per_group]]) for i in range(m // rows_per_group)]
    for i, want in enumerate(want_g):
        checks[f"group{i}.amax"] = _same(g[i:i + 1], want)
    for j in range(m // rows_per_member):
        r = slice(j * rows_per_member, (j + 1) * rows_per_member)
        scope = "tensor" if rows_per_member == rows_per_group else "group"
        want = nvfp4.quantize(x[r], scope=scope,
                              global_amax=None if scope == "tensor" else want_g[j * rows_per_member // rows_per_group])
        checks[f"member{j}.data"] = _same(data[r], want.data)
        checks[f"member{j}.scale"] = _same(scale[r], want.scale)
        checks[f"member{j}.global_scale"] = _same(sdec[j:j + 1], want.global_scale.reshape(1))
    return checks


def nvfp4_row_variant_checks(x, variant: dict) -> dict:
    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_nvfp4

    data, scale, sdec, g = triton_nvfp4.row_scaled(x.contiguous(), **variant)
    want = nvfp4.quantize(x, scope="row")
    return {"data": _same(data, want.data), "scale": _same(scale, want.scale),
            "global_scale": _same(sdec, want.global_scale), "amax": _same(g, want.global_amax)}


def nvfp4_non_finite_rows(dtype, seed: int, k: int = 224):
    """nvfp4_input [8, k] with +-inf, NaN next to finite values, an all-NaN block, a NaN-and-inf block and a row
    of NaNs only: where the packed block max (max.bf16x2 / max.f16x2) meets NaN."""
    x = nvfp4_input(8, k, dtype, seed)
    x[0, 3], x[0, 40], x[4, 17] = float("inf"), float("-inf"), float("nan")
    x[5, 32:48] = float("nan")
    x[6, 0:16:2], x[6, 1:16:2] = float("nan"), float("-inf")
    x[7] = float("nan")
    return x


def nvfp4_row_packed_non_finite_checks(dtype, seed: int) -> dict:
    """NaN / inf are outside the reference's bit-exact contract, so the packed block max is checked against the
    unpacked fp32 one (both NaN-ignoring): every output of row_scaled(packed=True) == row_scaled(packed=False).
    The fp32 max needs the interpreter's max to be the hardware's (nan_ignoring_max)."""
    from precision_dsl.kernels import triton_nvfp4

    nan_ignoring_max()
    x = nvfp4_non_finite_rows(dtype, seed)
    out = {}
    for chunk in (4, 16):
        got = triton_nvfp4.row_scaled(x, chunk=chunk, packed=True)
        want = triton_nvfp4.row_scaled(x, chunk=chunk, packed=False)
        for name, g, w in zip(("data", "scale", "S_dec", "amax"), got, want):
            out[f"chunk{chunk}.{name}"] = _same(g, w)
    return out


def nvfp4_segment_cases() -> list[tuple]:
    """(kind, dtype name, parameters) of the interpreted NVFP4 segment / per-row variant cases: every dtype runs the
    default launch and K = 224; bf16 also the other launch shapes and a one-block row (K = 16); every dtype the
    16x16 kernel's row splits (TILE2D_SPLITS) on an even and a masked shape."""
    out = []
    for dtype in ("bfloat16", "float16", "float32"):
        launches = NVFP4_SEG_LAUNCH if dtype == "bfloat16" else NVFP4_SEG_LAUNCH[:1]
        out += [("segment", dtype, (rpm, rpg, members, li)) for rpm, rpg, members in NVFP4_SEGMENTS
                for li in range(len(launches))]
        out.append(("non_finite", dtype, ()))
        out.append(("row_non_finite", dtype, ()))
        out += [("row", dtype, (224, vi)) for vi in range(len(NVFP4_ROW_VARIANTS))]
        out += [("tile2d", dtype, (shape, split)) for shape in TILE2D_SHAPES for split in TILE2D_SPLITS]
        out += [("tensor_l2", dtype, (shape,)) for shape in TENSOR_L2_SHAPES]
        out += [("tensor_packed", dtype, (shape,)) for shape in TENSOR_PACKED_SHAPES]
        out.append(("tensor_packed_non_finite", dtype, ()))
    out.append(("row", "bfloat16", (16, 0)))
    return out


# per-tensor 1x16 with the L2 hints: 64 x 1024 = 32768 pair words (32 amax programs of 1024: EVEN), 30 x 1040
# (15600 words: a masked last program, 68 blocks a row: masked quantize tiles)
TENSOR_L2_SHAPES = ((64, 1024), (30, 1040))
# per-tensor 1x16 with the packed block max (the interpreter calls max.bf16x2's model once per block and step: small
# shapes): 16 x 256 (16 blocks a row: whole 4-row tiles, a 16x16 stripe), 6 x 272 (17 blocks, a partial last row
# stripe: masked)
TENSOR_PACKED_SHAPES = ((16, 256), (6, 272))
TILE2D_SHAPES = ((32, 512), (48, 272))  # 32 blocks a row (EVEN at 16 tiles a program); 17 (masked)
TILE2D_SPLITS = (1, 2, 4)


def tile2d_checks(x, split: int) -> dict:
    """per_tensor 16x16 with the thread_rows kernel at this row split against the reference (data, scale, S_dec)."""
    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_nvfp4 as knv

    ref = nvfp4.quantize(x, scope="tensor", tile_2d=True)
    d, s, sd, _g = knv.per_tensor(x, tile_2d=True, split=split)
    return {"data": _same(d, ref.data), "scale": _same(s, ref.scale), "s_dec": _same(sd, ref.global_scale)}


def tensor_l2_checks(x) -> dict:
    """The L2 hints of per-tensor NVFP4 change no byte: the amax pass with its evict_last tail at several lengths
    (none, one program, part of the tensor, all of it) gives the reference amax, and the quantize pass with its
    evict_first loads / stores (l2_keep > 0) the reference data / scale / S_dec, in both walk orders. The same
    for the partial-max amax pass (amax_parts), G included."""
    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_nvfp4 as knv

    ref = nvfp4.quantize(x, scope="tensor")
    out = {}
    for keep in (0, 1, 4 * 1024 * 7, 1 << 40):  # bytes (a 1024-word program is 4 KiB of bf16 / fp16, 8 KiB of fp32)
        out[f"amax keep={keep}"] = _same(knv.tensor_amax(x, flat_block=1024, keep_bytes=keep), ref.global_amax)
    g = knv.tensor_amax(x, flat_block=1024, keep_bytes=4 * 1024 * 7)
    for reverse in (True, False):
        d, sc, sd, _g = knv.per_tensor(x, g, l2_keep=0.5, reverse=reverse)
        out[f"reverse={reverse} data"], out[f"reverse={reverse} scale"] = _same(d, ref.data), _same(sc, ref.scale)
        out[f"reverse={reverse} S_dec"] = _same(sd, ref.global_scale)
    # amax_parts: one partial max per amax program, reduced by the quantize kernel (several parts at 1024 words a
    # program; at the default 16384 these shapes would be one), and past AMAX_PARTS_MAX the atomic pass
    saved = knv.AMAX_FLAT_BLOCK, knv.AMAX_PARTS_MAX
    try:
        knv.AMAX_FLAT_BLOCK = 1024
        for limit in (saved[1], 2):
            knv.AMAX_PARTS_MAX = limit
            for reverse in (True, False):
                d, sc, sd, gp = knv.per_tensor(x, amax_parts=True, reverse=reverse)
                tag = f"parts<={limit} reverse={reverse}"
                out[f"{tag} data"], out[f"{tag} scale"] = _same(d, ref.data), _same(sc, ref.scale)
                out[f"{tag} S_dec"], out[f"{tag} G"] = _same(sd, ref.global_scale), _same(gp, ref.global_amax)
    finally:
        knv.AMAX_FLAT_BLOCK, knv.AMAX_PARTS_MAX = saved
    return out


def tensor_packed_checks(x) -> dict:
    """per_tensor(packed=True), the block amax on packed halves, against the reference: with its own amax pass
    (walking backwards and forwards, with the partial-max amax pass), with G given at the default tile and at
    8-row tiles, and, where M is a multiple of 16, the TILE_2D path's 16x16 tiles and (bf16) a tile whose blocks
    hold only subnormals (subnormal_input)."""
    import torch

    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_nvfp4 as knv

    ref = nvfp4.quantize(x, scope="tensor")
    out = {}
    runs = {"incl. amax": dict(), "incl. amax forwards": dict(reverse=False),
            "incl. amax parts": dict(amax_parts=True)}
    for name, cfg in runs.items():
        d, sc, sd, g = knv.per_tensor(x, packed=True, **cfg)
        out[f"{name} data"], out[f"{name} scale"] = _same(d, ref.data), _same(sc, ref.scale)
        out[f"{name} S_dec"], out[f"{name} G"] = _same(sd, ref.global_scale), _same(g, ref.global_amax)
    for name, cfg in {"G given": dict(), "G given 8-row tiles": dict(block_m=8)}.items():
        d, sc, sd, _g = knv.per_tensor(x, ref.global_amax, packed=True, **cfg)
        out[f"{name} data"], out[f"{name} scale"] = _same(d, ref.data), _same(sc, ref.scale)
        out[f"{name} S_dec"] = _same(sd, ref.global_scale)
    if x.shape[0] % 16 == 0:
        ref2 = nvfp4.quantize(x, scope="tensor", tile_2d=True)
        d, sc, sd, _g = knv.per_tensor(x, ref2.global_amax, tile_2d=True, thread_rows=False, packed=True)
        out["16x16 data"], out["16x16 scale"] = _same(d, ref2.data), _same(sc, ref2.scale)
    if x.dtype == torch.bfloat16 and x.shape[0] % 16 == 0:  # blocks of bf16 subnormals only: their packed max
        xs = subnormal_input(*x.shape, seed=131)
        refs = nvfp4.quantize(xs, scope="tensor")
        d, sc, sd, g = knv.per_tensor(xs, packed=True)
        out["subnormal data"], out["subnormal scale"] = _same(d, refs.data), _same(sc, refs.scale)
        out["subnormal G"] = _same(g, refs.global_amax)
    return out


def tensor_packed_non_finite_checks(dtype, seed: int) -> dict:
    """NaN / inf are outside the reference's bit-exact contract, so per_tensor(packed=True) is checked against
    packed=False (both NaN-ignoring), every output: with its own amax pass (G = inf here: S_enc = 1) and with a
    finite G given (saturated blocks next to all-NaN ones). Needs the hardware's max (nan_ignoring_max)."""
    import torch

    from precision_dsl.kernels import triton_nvfp4 as knv

    nan_ignoring_max()
    x = nvfp4_non_finite_rows(dtype, seed)
    out = {}
    finite_g = x.float().nan_to_num(0.0, 0.0, 0.0).abs().amax().reshape(1) / 4
    for name, g in (("incl. amax", None), ("G given", finite_g)):
        got = knv.per_tensor(x, g, packed=True)
        want = knv.per_tensor(x, g, packed=False)
        for part, a, b in zip(("data", "scale", "S_dec", "G"), got, want):
            out[f"{name} {part}"] = _same(a, b)
    out["G is inf"] = bool(torch.isinf(knv.per_tensor(x, packed=True)[3]).all())
    return out


def run_nvfp4_segments() -> None:
    import torch

    from precision_dsl.kernels import triton_segments as ks

    for i, (kind, dtype_name, params) in enumerate(nvfp4_segment_cases()):
        t0 = time.perf_counter()
        dtype = getattr(torch, dtype_name)
        if kind == "segment":
            rpm, rpg, members, li = params
            checks = nvfp4_segment_checks(nvfp4_input(rpm * members, 224, dtype, 2000 + i), rpm, rpg,
                                          NVFP4_SEG_LAUNCH[li])
            case = f"nvfp4_segment::{dtype_name}_rpm{rpm}_rpg{rpg}_x{members}_launch{li}"
        elif kind == "non_finite":  # bf16: the integer path of seg_amax, else the float path
            x = nvfp4_input(64, 224, dtype, 2000 + i)
            x[5, 3], x[9, 100], x[60, 0] = float("inf"), float("-inf"), float("nan")
            bad = torch.zeros(1, dtype=torch.int32)
            ks.seg_amax(x, 16, torch.zeros(4, dtype=torch.int32), bad)
            checks, case = {"count": int(bad.item()) == 3}, f"nvfp4_segment::{dtype_name}_non_finite"
        elif kind == "row_non_finite":
            checks = nvfp4_row_packed_non_finite_checks(dtype, 2000 + i)
            case = f"nvfp4_row::{dtype_name}_packed_non_finite"
        elif kind == "tile2d":
            (m, k), split = params
            checks = tile2d_checks(nvfp4_input(m, k, dtype, 2000 + i), split)
            case = f"nvfp4_tile2d::{dtype_name}_{m}x{k}_split{split}"
        elif kind == "tensor_l2":
            (m, k), = params
            checks = tensor_l2_checks(nvfp4_input(m, k, dtype, 2000 + i))
            case = f"nvfp4_tensor_l2::{dtype_name}_{m}x{k}"
        elif kind == "tensor_packed":
            (m, k), = params
            checks = tensor_packed_checks(nvfp4_input(m, k, dtype, 2000 + i))
            case = f"nvfp4_tensor_packed::{dtype_name}_{m}x{k}"
        elif kind == "tensor_packed_non_finite":
            checks = tensor_packed_non_finite_checks(dtype, 2000 + i)
            case = f"nvfp4_tensor_packed::{dtype_name}_non_finite"
        else:
            k, vi = params
            checks = nvfp4_row_variant_checks(nvfp4_input(8, k, dtype, 2000 + i), NVFP4_ROW_VARIANTS[vi])
            case = f"nvfp4_row::{dtype_name}_k{k}_{vi}"
        print(json.dumps({"case": case, "checks": checks, "seconds": round(time.perf_counter() - t0, 2)}),
              flush=True)
# ---- bf16 subnormal tiles ------------------------------------------------------------------------------------------
# Blocks whose bf16 elements are all subnormal (|x| < 2^-126): their amax gives E8M0 = 0 / huge FP8 block and NVFP4
# scales, so x * s is a normal fp32 value and every element gets a non-zero code. No golden vectors: the kernel path
# against the reference quantization of the same x (tests/test_kernels.py runs them on the GPU).
SUBNORMAL_SHAPE = (256, 256)


def subnormal_input(m: int, k: int, seed: int):
    """bf16 [m, k]: the rows [0, m/2) hold only bf16 subnormals, (rand * 2 - 1) * 2^-130 (every 32-, 16-, 1x128 and,
    for m = 256, 128x128 block of them is all-subnormal); row 1 the smallest subnormals +-2^-133 and zeros; the rows
    [m/2, m) a normal-range tile of which every other 32-column block is subnormal."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(m, k, generator=g) * 2 - 1) * 2.0 ** -130
    x[1] = torch.tensor([2.0 ** -133, -(2.0 ** -133), 0.0, -0.0]).repeat(k // 4)
    normal = torch.randn(m - m // 2, k, generator=g) * 3
    x[m // 2:] = torch.where((torch.arange(k) // 32) % 2 == 0, normal, x[m // 2:])
    return x.to(torch.bfloat16)


def subnormal_cases() -> list[str]:
    """The kernel calls of run_subnormal, by name."""
    out = [f"mxfp8_{el}_{axis}" for el in ("e4m3", "e5m2") for axis in ("row", "col")]
    out += [f"mxfp8_rowcol_{el}" for el in ("e4m3", "e5m2")]
    out += [f"nvfp4_{scope}_{'16x16' if t2 else '1x16'}_{axis}" for scope in ("tensor", "row") for t2 in (False, True)
            for axis in ("row", "col") if not (t2 and scope == "row")]
    out += [f"fp8block_{el}_{b}_{'pow2' if p else 'fp32'}_{axis}" for el in ("e4m3", "e5m2") for b in ("1x128", "128x128")
            for p in (True, False) for axis in ("row", "col")]
    out += [f"fp8block_rowcol_{el}_{'pow2' if p else 'fp32'}" for el in ("e4m3", "e5m2") for p in (True, False)]
    return out


def _q_checks(got, want) -> dict:
    checks = {"path": got.kernel == "triton", "keys": set(got.tensors()) == set(want.tensors()),
              "meta": (tuple(got.shape), got.axis, got.fmt) == (tuple(want.shape), want.axis, want.fmt)}
    for key, w in want.tensors().items():
        checks[key] = key in got.tensors() and _same(got.tensors()[key].cpu(), w)
    return checks


def subnormal_checks(x, case: str) -> dict:
    """Every output tensor of the kernel call `case` (a subnormal_cases() name) on x (CUDA, or CPU under the
    interpreter) equals the reference quantization of x.cpu()."""
    from precision_dsl import kernels

    parts = case.split("_")
    if case.startswith("mxfp8_rowcol"):
        def call(v, k):
            return kernels.mxfp8_quantize_rowcol(v, parts[2], kernel=k)
    elif case.startswith("fp8block_rowcol"):
        def call(v, k):
            return kernels.fp8_block_quantize_rowcol(v, parts[2], parts[3] == "pow2", kernel=k)
    elif parts[0] == "mxfp8":
        def call(v, k):
            return kernels.mxfp8_quantize(v, parts[1], axis=parts[2], kernel=k)
    elif parts[0] == "nvfp4":
        def call(v, k):
            return kernels.nvfp4_quantize(v, axis=parts[3], scope=parts[1], tile_2d=parts[2] == "16x16", kernel=k)
    else:
        def call(v, k):
            return kernels.fp8_block_quantize(v, parts[1], (1, 128) if parts[2] == "1x128" else (128, 128),
                                              parts[3] == "pow2", axis=parts[4], kernel=k)
    got, want = call(x, "triton"), call(x.cpu(), "reference")
    if isinstance(want, tuple):  # the row+col calls: (rowwise, columnwise)
        return {f"{n}.{c}": ok for n, g, w in zip(("row", "col"), got, want) for c, ok in _q_checks(g, w).items()}
    return _q_checks(got, want)


def run_subnormal() -> None:
    x = subnormal_input(*SUBNORMAL_SHAPE, seed=130)
    for case in subnormal_cases():
        t0 = time.perf_counter()
        print(json.dumps({"case": f"subnormal::{case}", "checks": subnormal_checks(x, case),
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


def cases(max_elements: int) -> list[tuple[str, str]]:
    """(file, variant) of every golden case small enough for the interpreter that a kernel covers."""
    from safetensors import safe_open

    out = []
    for f in json.loads((GOLDEN_DIR / "index.json").read_text())["files"]:
        with safe_open(str(GOLDEN_DIR / f["file"]), "pt") as st:
            shape = st.get_slice("input").get_shape()
        numel = 1
        for d in shape:
            numel *= d
        if numel > max_elements or any(n in f["file"] for n in NAN_INPUTS):
            continue
        out += [(f["file"], v) for v in f["variants"] if not v.endswith("_32x32")]  # no 32x32 MXFP8 kernel
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    exact_fp8_cast()
    exact_bf16_widening()
    if sys.argv[1:] == ["fp8_pad_rowcol"]:
        run_fp8_pad_rowcol()
        return
    if sys.argv[1:] == ["nvfp4_segments"]:
        run_nvfp4_segments()
        return
    kind = sys.argv[2] if len(sys.argv) > 2 else ""  # optional: only the golden files of this kind (nvfp4, ...)
    if sys.argv[1:] == ["subnormal"]:
        run_subnormal()
        return
    for file, variant in cases(int(sys.argv[1]) if len(sys.argv) > 1 else 8192):
        if kind and not file.startswith(f"{kind}__"):
            continue
        t0 = time.perf_counter()
        result = run_case(file, variant)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
