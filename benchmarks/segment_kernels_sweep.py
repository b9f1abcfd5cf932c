"""Launch shapes of the weight update's grouped NVFP4 kernels on one layer of a Qwen3-30B-A3B-shaped model (H200).

    source benchmarks/device_setup.sh && python3 benchmarks/segment_kernels_sweep.py

fc1 of one layer = 128 experts x (gate 768 + up 768) rows x 2048, bf16 (403 MB), gate+up of an expert sharing one
amax (NVFP4 share-scale group). For each launch shape: GPU time (triton do_bench, median) of the amax pass and of the
quantize pass, their bandwidth (bytes read + written / time) against a device-to-device copy of the input measured
in the same run, and whether the bytes equal the default launch's (they must: the shape is not part of the result).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    import triton.testing as tt

    from precision_dsl.kernels import triton_segments as ks

    dev = "cuda"
    e, n, k = 128, 768, 2048
    m = e * 2 * n
    x = (torch.randn((m, k), device=dev) * 0.02).to(torch.bfloat16)
    rpg, rpm = 2 * n, n
    nbytes = x.numel() * 2
    dst = torch.empty_like(x)
    t_copy = tt.do_bench(lambda: dst.copy_(x), warmup=5, rep=50)
    print(f"copy of {nbytes / 1e6:.0f} MB: {t_copy * 1e3:.0f} us, {2 * nbytes / t_copy / 1e6:.0f} GB/s (read+write)")

    def run_amax(**kw):
        bits = torch.zeros(m // rpg, dtype=torch.int32, device=dev)
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
        ks.seg_amax(x, rpg, bits, bad, **kw)
        return bits

    ref_bits = run_amax()
    g = ref_bits.view(torch.float32)
    rows = []
    for elems in (8192, 16384, 32768):
        for w in (4, 8):
            same = torch.equal(run_amax(elems=elems, num_warps=w), ref_bits)
            bits = torch.zeros(m // rpg, dtype=torch.int32, device=dev)
            bad = torch.zeros(1, dtype=torch.int32, device=dev)
            t = tt.do_bench(lambda: ks.seg_amax(x, rpg, bits, bad, elems=elems, num_warps=w), warmup=5, rep=50)
            rows.append({"kernel": "amax", "elems": elems, "num_warps": w, "us": t * 1e3,
                         "gbps": nbytes / t / 1e6, "vs_copy_bw": (nbytes / t) / (2 * nbytes / t_copy), "same": same})
    data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((m, k // 16), dtype=torch.uint8, device=dev)
    sdec = torch.empty(m // rpm, dtype=torch.float32, device=dev)
    ks.nvfp4_segment(x, g, rpg, rpm, data, scale, sdec)
    ref = (data.clone(), scale.clone(), sdec.clone())
    moved = nbytes + data.numel() + scale.numel()
    for bm in (2, 4, 8):
        for bnb in (32, 64, 128):
            for w in (2, 4, 8):
                if bm * bnb * 16 // (32 * w) < 8:  # fewer than 8 elements per thread: skip
                    continue
                fn = lambda: ks.nvfp4_segment(x, g, rpg, rpm, data, scale, sdec, block_m=bm, block_nb=bnb,
                                              num_warps=w)
                fn()
                same = all(torch.equal(a, b) for a, b in zip((data, scale, sdec), ref))
                t = tt.do_bench(fn, warmup=5, rep=50)
                rows.append({"kernel": "nvfp4", "block_m": bm, "block_nb": bnb, "num_warps": w, "us": t * 1e3,
                             "gbps": moved / t / 1e6, "vs_copy_bw": (moved / t) / (2 * nbytes / t_copy), "same": same})
    for kind in ("amax", "nvfp4"):
        rs = sorted((r for r in rows if r["kernel"] == kind), key=lambda r: r["us"])
        default = next(r for r in rows if r["kernel"] == kind and r.get("elems", 8192) == 8192
                       and r.get("block_m", 2) == 2 and r.get("block_nb", 128) == 128
                       and r["num_warps"] == (4 if kind == "amax" else 2))
        print(f"{kind}: default {default['us']:.0f} us ({default['vs_copy_bw']:.2f} of copy bw); best 3: " + "; ".join(
            f"{ {k: v for k, v in r.items() if k in ('elems', 'block_m', 'block_nb', 'num_warps')} } {r['us']:.0f} us "
            f"({r['vs_copy_bw']:.2f}) same={r['same']}" for r in rs[:3]))
    if len(sys.argv) > 2 and sys.argv[1] == "--out":
        Path(sys.argv[2]).write_text(json.dumps({"copy_us": t_copy * 1e3, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
