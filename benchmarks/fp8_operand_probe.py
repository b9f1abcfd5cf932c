"""Probe: the trainer's 1x128 FP8 operand kernels at its shapes (H200): rowwise, columnwise (token-padded) and both
from one read (ROWCOL), each against a device copy of the same bf16 input (the bandwidth limit), in one run.

    python3 benchmarks/fp8_operand_probe.py --out fp8_operands.json

Shapes: moe-h3072 / h4096 micro-batch activations (tokens x hidden), one expert's input (tokens x hidden) and its
down_proj input (tokens x intermediate). Times: triton.testing.do_bench median (L2 is 60 MB; these inputs are
75-400 MB, so each call is L2-cold). The ROWCOL launch configs (block_c, num_warps) are swept: the kernel's default
is the first row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("fp8_operands.json"))
    a = ap.parse_args()
    import triton.testing

    from precision_dsl.kernels import triton_fp8_block as kern

    rows = []
    for m, k in ((49152, 3072), (12288, 3072), (12288, 2048), (12288, 4096), (3000, 6144)):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = torch.empty_like(x)
        bench = lambda f: triton.testing.do_bench(f, warmup=5, rep=40)  # noqa: E731
        copy = bench(lambda: y.copy_(x))
        r = {"shape": [m, k], "copy_ms": copy,
             "row_ms": bench(lambda: kern.quantize(x, pad_rows_to=16)),
             "col_ms": bench(lambda: kern.quantize(x, transpose=True, pad_rows_to=128))}
        for bc, nw in ((None, 8), (128, 4), (256, 8), (256, 4), (512, 8)):
            try:
                r[f"rowcol_bc{bc}_w{nw}_ms"] = bench(lambda: kern.quantize_rowcol(x, pad_rows_to=128, block_c=bc,
                                                                                   num_warps=nw, row_pad_to=16))
            except Exception as e:  # noqa: BLE001
                r[f"rowcol_bc{bc}_w{nw}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(r)
        print(" ".join(f"{k_}={v:.3f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()), flush=True)
    a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
