"""Time `load_architecture` for every bundled model (CPU time, best of N, warm imports) and a cold process.

    python benchmarks/arch_speed.py [--repeat 5]

Requirement: DeepSeek-V3 (46,183 tensors) < 0.3 s CPU. Prints one line per model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    t0 = time.perf_counter()
    from precision_dsl.arch import list_bundled, load_architecture

    print(f"import precision_dsl.arch: {time.perf_counter() - t0:.3f} s (wall)")
    for name in list_bundled():
        load_architecture(name)  # warm the file cache
        cpu = []
        for _ in range(args.repeat):
            start = time.process_time()
            arch = load_architecture(name)
            cpu.append(time.process_time() - start)
        print(f"{name:16s} {len(arch.tensors):7d} tensors {arch.total_params / 1e9:9.3f} B params   "
              f"CPU best {min(cpu) * 1e3:7.1f} ms  median {sorted(cpu)[len(cpu) // 2] * 1e3:7.1f} ms")

    code = ("import time; t=time.process_time(); from precision_dsl.arch import load_architecture; "
            "a=load_architecture('deepseek-v3'); print(f'{time.process_time()-t:.3f}')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    print(f"cold process, import + load_architecture('deepseek-v3'): {out} s CPU")


if __name__ == "__main__":
    main()
