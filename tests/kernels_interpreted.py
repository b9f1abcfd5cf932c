"""Run the fused Triton kernels on CPU under Triton's interpreter and compare them with the TE golden vectors.

    TRITON_INTERPRET=1 python tests/kernels_interpreted.py [MAX_ELEMENTS]   # prints one JSON result per case

Driven by tests/test_kernels_interpret.py in a fresh process: triton decides compiled vs interpreted when a kernel
is decorated, so the environment variable must be set before the kernel modules are imported.

Triton 3.6's interpreter models the GPU with numpy; in one place its model is not the hardware's and the check
gives it the hardware's rule: the fp32 -> fp8 cast. The kernels use `.to(tl.float8e4nv / tl.float8e5)`, which on
sm_89+ is `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32` (round to nearest even, finite overflow and +-inf clamp to +-Fmax,
NaN -> 0x7F); the interpreter's `_convert_float` instead rounds on the single cut-off bit with no ties-to-even, no
carry into the exponent and no saturation (about 20 % of MXFP8 bytes come out one code off). `exact_fp8_cast`
replaces that one builder method with the PTX rule (clamp, then torch's RNE cast). Everything else -- loads, bit
manipulation, block maxima, E8M0 / E2M1 / E4M3-scale arithmetic, division, packing, stores -- is the kernels' own
code run by the interpreter, and every output byte is compared.
"""

from __future__ import annotations

import json
import os
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
    for file, variant in cases(int(sys.argv[1]) if len(sys.argv) > 1 else 8192):
        t0 = time.perf_counter()
        result = run_case(file, variant)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
