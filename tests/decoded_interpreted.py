"""The one-launch quantize-and-decode kernels (kernels.quantize_decoded / quantize_with_decoded) on CPU under Triton's
interpreter, bitwise against the references. Run in a fresh process with TRITON_INTERPRET=1
(tests/test_kernels_decoded.py does); prints one JSON line per case.

Unlike tests/decode_interpreted.py, these kernels produce the fp8 bytes themselves, so the interpreter's fp32 -> fp8
cast (not the hardware's cvt.rn.satfinite, see tests/kernels_interpreted.py) is involved: as there, that one builder
method is given the PTX rule (`kernels_interpreted.exact_fp8_cast`); everything else is the kernels' own code. Inputs
hold no NaN (the interpreter's block max propagates NaN, the GPU's max.f32 ignores it) and no fp32 subnormals (its
bf16 <-> fp32 conversions mishandle them: a bf16 subnormal input loads wrong, a subnormal value rounds wrong - the
existing quantize kernels show the same under the interpreter); both are covered on the GPU
(tests/test_kernels_decoded.py::test_one_launch_values_are_bitwise_decode_op_of_quantize_on_gpu).

Per case, every element / byte compared:
  * values (bf16) == the decode kernels (triton_decode, interpreted) of the REFERENCE quantizer's bytes, i.e.
    `fastgemm.decode_op(quantize(x)).v` (MXFP8: fp8 element x 2^(E-127) rounded to bf16; NVFP4: E2M1 x E4M3 scale);
  * values * s_dec == formats.dequantize(reference) (NVFP4: fp32, bitwise; MXFP8: s_dec is None and the values equal
    the reference dequantization rounded to bf16, exact except in blocks with E8M0 < 3);
  * s_dec == the reference's global_scale (NVFP4), and quantize_with_decoded's bytes == the reference's bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def inputs():
    """(name, x) pairs: random rows over ~20 binades plus edge-case blocks, M not a multiple of 16, M = 1, K = 3072."""
    import torch

    g = torch.Generator().manual_seed(0)

    def spread(m, k):
        return torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 8, (m, 1), generator=g).float())

    x = spread(37, 256)
    x[3, :32] = 0.0  # all-zero block
    x[4, 32:64] = -0.0  # negative zeros stay -0.0
    x[4, 64:96] = 0.0
    x[4, 70] = -0.0  # one -0.0 in a zero block
    x[5, 40] = 3e38  # block scale at the top of E8M0 / saturating elements
    x[5, 41] = -3.3e38
    x[6, 64:96] = 1e-30  # tiny block (E8M0 ~ 27)
    x[7, :16] = -1e-3  # small negatives that round to -0.0 next to a large element
    x[7, 16] = 1e4
    # a block near the bottom of E8M0 (E ~ 9) whose elements all stay normal: fp32 subnormals (inputs, or MXFP8 values
    # of blocks with E8M0 < ~10) are left to the GPU test, the interpreter's bf16 <-> fp32 casts mishandle them
    x[8, 96:128] = 1e-33 * torch.linspace(0.5, 1.0, 32) * (1 - 2 * (torch.arange(32) % 2))
    x[9, 128:160] = float("inf")  # +-inf saturate to +-Fmax, amax inf
    x[9, 130] = float("-inf")
    x[10, 160:192] = 448.0 * torch.linspace(-1.5, 1.5, 32)  # over the E4M3 range at E8M0 = 127 + ...
    x[11, :] = 6.0 * torch.arange(256).remainder(13).float() - 36.0  # E2M1 ties and the +-6 edge
    return [("random-37x256", x), ("one-row-1x3072", spread(1, 3072)), ("k3072-3x3072", spread(3, 3072)),
            ("zeros-2x64", torch.zeros(2, 64)), ("neg-zeros-2x64", torch.full((2, 64), -0.0))]


def main() -> None:
    import torch

    import kernels_interpreted as ki
    from precision_dsl import formats, kernels
    from precision_dsl.kernels.triton_decode import mxfp8_decode_bf16, nvfp4_decode_bf16
    from precision_dsl.precision import FormatKind, TensorFormat

    ki.exact_fp8_cast()
    fmts = [(f"mxfp8-{e}", TensorFormat(kind=FormatKind.MXFP8, element=e, block=(1, 32), scale_dtype="e8m0"))
            for e in ("e4m3", "e5m2")]
    fmts += [(f"nvfp4-{s}", TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3",
                                         global_scale=s)) for s in ("row", "tensor")]

    def bits(t):
        return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    for xname, x32 in inputs():
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x = x32.to(dtype)
            if dtype == torch.float16 and not bool(torch.isfinite(x32.to(torch.float16)).all()):
                x = x32.clamp(-6e4, 6e4).to(dtype)  # fp16 cannot hold the large elements: keep the case finite
            for fname, fmt in fmts:
                ref = formats.quantize(x, fmt)
                v, s = kernels.quantize_decoded(x, fmt)
                q, v2, s2 = kernels.quantize_with_decoded(x, fmt)
                checks = {"one-launch values == with-bytes values": torch.equal(bits(v), bits(v2))}
                if fmt.kind == FormatKind.MXFP8:
                    dec = mxfp8_decode_bf16(ref.data, ref.scale, fmt.element, "row")
                    checks["s_dec is None"] = s is None and s2 is None
                    checks["values == decode kernel of reference bytes"] = torch.equal(bits(v), bits(dec))
                    want = formats.dequantize(ref).to(torch.bfloat16)
                    checks["values == bf16(reference dequantize)"] = torch.equal(bits(v), bits(want))
                else:
                    dec = nvfp4_decode_bf16(ref.data, ref.scale)
                    checks["values == decode kernel of reference bytes"] = torch.equal(bits(v), bits(dec))
                    checks["s_dec == reference global_scale"] = torch.equal(bits(s), bits(ref.global_scale))
                    ss = s.view(-1, 1) if s.numel() > 1 else s.reshape(())
                    checks["values * s_dec == reference dequantize"] = torch.equal(bits(v.float() * ss),
                                                                                  bits(formats.dequantize(ref)))
                    checks["global_amax == reference"] = torch.equal(bits(q.global_amax), bits(ref.global_amax))
                checks["bytes == reference bytes"] = torch.equal(q.data, ref.data) and torch.equal(q.scale, ref.scale)
                checks["shape"] = tuple(v.shape) == tuple(x.shape) and v.dtype == torch.bfloat16
                print(json.dumps({"case": f"{fname}/{xname}/{str(dtype)[6:]}", "checks": checks}), flush=True)
    # what the one-launch path does not take: None, so callers run quantize + decode (which raise for bad shapes)
    other = {"fp8_block 1x128": TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=(1, 128),
                                             scale_dtype="pow2"),
             "mxfp8 32x32": TensorFormat(kind=FormatKind.MXFP8, element="e4m3", block=(32, 32), scale_dtype="e8m0"),
             "nvfp4 16x16": TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(16, 16), scale_dtype="e4m3",
                                         global_scale="tensor"),
             "nvfp4 group": TensorFormat(kind=FormatKind.NVFP4, element="e2m1", block=(1, 16), scale_dtype="e4m3",
                                         global_scale="group"),
             "bf16": TensorFormat(kind=FormatKind.BF16, element="bf16")}
    x = torch.randn(32, 64)
    checks = {name: kernels.quantize_decoded(x, f) is None for name, f in other.items()}
    checks["mxfp8 K % 32 != 0"] = kernels.quantize_decoded(torch.randn(4, 48), fmts[0][1]) is None
    checks["nvfp4 K % 16 != 0"] = kernels.quantize_decoded(torch.randn(4, 40), fmts[2][1]) is None
    checks["empty"] = kernels.quantize_decoded(torch.randn(0, 64), fmts[0][1]) is None
    checks["int tensor"] = kernels.quantize_decoded(torch.ones(4, 64, dtype=torch.int32), fmts[0][1]) is None
    print(json.dumps({"case": "declines", "checks": checks}), flush=True)


if __name__ == "__main__":
    main()
