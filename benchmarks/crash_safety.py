"""Cost of the crash-safety and integrity machinery (the converter's fsyncs, the weight update's per-bucket
checksums), measured on this machine in one run.

    python benchmarks/crash_safety.py [--layers 4] [--shards 4] [--bucket-mib 64]

1. converter: the same conversion (mxfp8-e2e, synthetic Qwen3-MoE, see benchmarks/convert.py) timed with the real
   fsyncs (per shard, per marker, per directory: what `policyc convert` does) and with fsync replaced by a no-op;
   the difference is what durability costs. Also reports the number of fsyncs and of filesystem mutations.
2. weight update: per-bucket checksum (always on) vs the bucket size: CRC32 on host buffers, the sum64 device
   checksum run on the CPU for reference, and sha256 (what check_equal adds per tensor), in GB/s; plus the
   quantization time of the same bytes for scale.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import torch

    from benchmarks.convert import arch_config
    from precision_dsl.arch.loader import architecture_from_config
    from faultfs import FaultFS
    from precision_dsl.backends import converter
    from precision_dsl.backends.synthetic import write_synthetic_checkpoint
    from precision_dsl.backends.weight_update import bucket_checksum
    from precision_dsl.resolve import resolve

    work = Path(tempfile.mkdtemp(prefix="policyc-crash-bench-"))
    arch = architecture_from_config(arch_config(args.layers), "bench-moe")
    src = work / "src"
    write_synthetic_checkpoint(arch, src, shards=args.shards, seed=0)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    plan = resolve(REPO / "policies" / "mxfp8-e2e.policy", arch, None)
    converter.convert(src, plan, work / "warm")

    def timed(real_fsync: bool, i: int) -> tuple[float, int, int]:
        fs = FaultFS(real_fsync=real_fsync)
        t = time.perf_counter()
        with fs.installed():
            converter.convert(src, plan, work / f"o{int(real_fsync)}{i}")
        return time.perf_counter() - t, sum(op == "fsync" for op, _ in fs.ops), len(fs.ops)

    rows = {True: [], False: []}
    for i in range(args.reps):
        for real in (True, False):
            rows[real].append(timed(real, i))
    with_fsync = min(r[0] for r in rows[True])
    without = min(r[0] for r in rows[False])
    print(f"converter: {size / 2**20:.0f} MiB BF16 source, {args.shards} shards, {len(arch.tensors)} tensors")
    print(f"  with fsync {with_fsync:.2f} s ({size / with_fsync / 2**20:.0f} MiB/s), fsync no-op {without:.2f} s "
          f"-> durability costs {100 * (with_fsync - without) / without:+.1f}% "
          f"({rows[True][0][1]} fsyncs, {rows[True][0][2]} filesystem mutations, best of {args.reps})")

    n = args.bucket_mib << 20
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8)

    def rate(fn, reps=3, nbytes=n) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return nbytes / best / 1e9

    crc = rate(lambda: bucket_checksum(buf, "crc32"))
    s64 = rate(lambda: bucket_checksum(buf, "sum64"))
    sha = rate(lambda: hashlib.sha256(buf.numpy().tobytes()).hexdigest())
    from precision_dsl.formats import quantize

    x = torch.randn(n // 4096, 4096).to(torch.bfloat16)  # an MXFP8 bucket of n bytes comes from ~n bf16 elements
    fmt = next(t.precision.weight for t in plan.tensors if t.precision.weight.is_quantized)
    q = rate(lambda: quantize(x, fmt, axis="row"), reps=1, nbytes=n)
    print(f"bucket checksum on a {args.bucket_mib} MiB host bucket (GB/s of bucket bytes, best of 3):")
    print(f"  crc32 (always on, host) {crc:.2f} | sum64 (always on, device; here on CPU) {s64:.2f} | "
          f"sha256 (check_equal) {sha:.2f} | mxfp8 quantization producing the bucket {q:.2f}")
    print(f"  crc32 adds {100 * (1 / crc) / (1 / q):.1f}% to quantizing the same update on this CPU")


if __name__ == "__main__":
    main()
