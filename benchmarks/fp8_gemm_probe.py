"""Does this torch run FP8 GEMMs with DeepSeek-style block scales (activations 1x128, weights 128x128) natively on
Hopper, and how fast against the BF16 GEMM of the same shape? (whether fp8-blockwise-hopper can run its GEMMs
natively). Operands come from our own byte-exact quantizers (precision_dsl.kernels.fp8_block_quantize).

    python3 benchmarks/fp8_gemm_probe.py --out $OUT/fp8_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("fp8_probe.json"))
    args = ap.parse_args()
    import torch
    import triton

    from precision_dsl import kernels

    res = {"torch": torch.__version__, "rows": []}
    dev = "cuda"
    for (m, k, n) in [(8192, 2048, 1536), (8192, 4096, 4096), (16384, 7168, 4096)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        qa = kernels.fp8_block_quantize(x, block=(1, 128), pow2=False)
        qb = kernels.fp8_block_quantize(w, block=(128, 128), pow2=False)
        a8 = qa.data.view(torch.float8_e4m3fn)
        b8 = qb.data.view(torch.float8_e4m3fn)
        sa, sb = qa.scale.float(), qb.scale.float()  # scale_inv (dequant multipliers): [m, k/128], [n/128, k/128]
        ref = (a8.float() * sa.repeat_interleave(128, 1)[:, :k]) @ (b8.float() * sb.repeat_interleave(128, 0)
                                                                     .repeat_interleave(128, 1)[:n, :k]).t()
        t_bf16 = triton.testing.do_bench(lambda: x @ w.t(), return_mode="median")
        row = {"shape": [m, k, n], "bf16_ms": t_bf16, "tflops_bf16": 2 * m * k * n / t_bf16 / 1e9, "variants": {}}
        tries = {
            "scaled_mm(sa [M,K/128] outer-major, sb [N/128,K/128] -> [K/128,N/128])":
                lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa.t().contiguous().t(), scale_b=sb.t(),
                                         out_dtype=torch.bfloat16),
            "scaled_mm(sa contiguous, sb.t())":
                lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16),
            "scaled_mm(sa contiguous, sb.t().contiguous())":
                lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t().contiguous(),
                                         out_dtype=torch.bfloat16),
        }
        for name, fn in tries.items():
            try:
                out = fn()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                t = triton.testing.do_bench(fn, return_mode="median")
                row["variants"][name] = {"ok": True, "ms": t, "rel_err_vs_fp32_dequant": err, "x_bf16": t / t_bf16}
            except Exception as e:  # noqa: BLE001 - a probe: record what this torch says
                row["variants"][name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
