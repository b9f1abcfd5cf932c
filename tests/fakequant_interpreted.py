"""The fused MXFP8 fake-quant kernel (kernels/triton_fakequant.py) on CPU under Triton's interpreter, bitwise
against the reference fake quantization (formats.mxfp8.fake_quantize). Run in a fresh process with
TRITON_INTERPRET=1 (tests/test_engine_fastgemm.py does); prints one JSON line per case. The interpreter's fp32->fp8
cast is given the hardware's cvt.rn.satfinite rule, as in tests/kernels_interpreted.py (its own model of the cast
does not carry into the exponent); everything else is the kernel's code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    import kernels_interpreted as ki
    from precision_dsl import formats
    from precision_dsl.kernels.triton_fakequant import mxfp8_fake_quantize_bf16
    from precision_dsl.precision import FormatKind, TensorFormat

    ki.exact_fp8_cast()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 256, generator=g) * torch.exp2(torch.randint(-12, 8, (40, 1), generator=g).float())
    x[3, :32] = 0.0  # all-zero block
    x[4, 32:64] = -0.0
    x[5, 40] = 3e38  # block scale near the top of E8M0
    x[6, 64:96] = 1e-30  # tiny block (E8M0 ~ 20: still bf16-exact)
    for dtype in (torch.float32, torch.bfloat16):
        for element in ("e4m3", "e5m2"):
            fmt = TensorFormat(kind=FormatKind.MXFP8, element=element, block=(1, 32), scale_dtype="e8m0")
            for axis in ("row", "col"):
                xi = x.to(dtype)
                got = mxfp8_fake_quantize_bf16(xi.contiguous(), element, axis)
                xp = torch.cat([xi, xi.new_zeros(24, 256)]) if axis == "col" else xi  # reference pads to 32 rows
                want = formats.fake_quantize(xp, fmt, axis=axis, out_dtype=torch.float32)[:40]
                same = torch.equal(got.float().view(torch.int32), want.view(torch.int32))
                print(json.dumps({"case": f"{dtype}-{element}-{axis}", "same": same}), flush=True)
    # NVFP4 element decode: bf16(e2m1 x E4M3 scale) * S_dec == the reference dequantization, bitwise
    from precision_dsl.kernels.triton_fakequant import nvfp4_decode_bf16

    for per_row in (True, False):
        fmt = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3",
                           global_scale="row" if per_row else "tensor")
        q = formats.quantize(x, fmt)
        s = q.global_scale.view(-1, 1) if per_row else q.global_scale.reshape(())
        got = nvfp4_decode_bf16(q.data, q.scale).float() * s
        same = torch.equal(got.view(torch.int32), formats.dequantize(q).view(torch.int32))
        print(json.dumps({"case": f"nvfp4-decode-{'row' if per_row else 'tensor'}", "same": same}), flush=True)


if __name__ == "__main__":
    main()
