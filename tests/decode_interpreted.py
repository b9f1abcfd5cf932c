"""The decode kernels (kernels/triton_decode.py) on CPU under Triton's interpreter, bitwise against the reference
dequantization (formats.dequantize). Run in a fresh process with TRITON_INTERPRET=1 (tests/test_engine_fastgemm.py
does); prints one JSON line per case. Bytes come from the reference quantizers, so the interpreter's fp32->fp8 cast
(not the hardware's, see tests/kernels_interpreted.py) is never involved: the kernels only decode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from precision_dsl import formats
    from precision_dsl.kernels.triton_decode import mxfp8_decode_bf16, nvfp4_decode_bf16
    from precision_dsl.precision import FormatKind, TensorFormat

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-12, 8, (64, 1), generator=g).float())
    x[3, :32] = 0.0  # all-zero block
    x[4, 32:64] = -0.0  # negative zeros must stay -0.0
    x[5, 40] = 3e38  # block scale near the top of E8M0
    x[6, 64:96] = 1e-30  # tiny block (E8M0 ~ 27: still bf16-exact)
    x[7, :16] = -1e-3  # small negatives that round to -0.0 in a block with a large amax
    x[7, 16] = 1e4
    for element in ("e4m3", "e5m2"):
        fmt = TensorFormat(kind=FormatKind.MXFP8, element=element, block=(1, 32), scale_dtype="e8m0")
        for axis in ("row", "col"):
            q = formats.quantize(x, fmt, axis=axis)
            got = mxfp8_decode_bf16(q.data, q.scale, element, axis).float()
            want = formats.dequantize(q)
            same = torch.equal(got.view(torch.int32), want.view(torch.int32))
            print(json.dumps({"case": f"mxfp8-{element}-{axis}", "same": same}), flush=True)
    for per_row in (True, False):  # NVFP4: bf16(e2m1 x E4M3 scale) * S_dec == the reference dequantization
        fmt = TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3",
                           global_scale="row" if per_row else "tensor")
        q = formats.quantize(x, fmt)
        s = q.global_scale.view(-1, 1) if per_row else q.global_scale.reshape(())
        got = nvfp4_decode_bf16(q.data, q.scale).float() * s
        same = torch.equal(got.view(torch.int32), formats.dequantize(q).view(torch.int32))
        print(json.dumps({"case": f"nvfp4-decode-{'row' if per_row else 'tensor'}", "same": same}), flush=True)


if __name__ == "__main__":
    main()
