"""CPU time of `policyc plan` for the largest bundled model (DeepSeek-V3, ~48k tensors).

    python benchmarks/plan_speed.py [--policy policies/nvfp4-pertoken-dequant-backward.policy] [--model deepseek-v3]

Prints: architecture enumeration time, resolution time (the plan itself, goal < 1 s CPU), and the wall time of the
whole CLI calls `policyc plan`, `plan --json` and `emit` in fresh processes including imports (issue 12 goals:
plan --json < 1 s CPU, emit < 3 s CPU on the 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Measure this checkout (the CLI children run in ROOT too), not whichever precision_dsl is installed: a script's
# sys.path[0] is benchmarks/, so an editable install of another checkout would otherwise win.
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default=str(ROOT / "policies" / "nvfp4-pertoken-dequant-backward.policy"))
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    arch_t, res_t = [], []
    for _ in range(args.repeat):
        t0 = time.process_time()
        arch = load_architecture(args.model)
        t1 = time.process_time()
        plan = resolve(args.policy, arch)
        t2 = time.process_time()
        arch_t.append(t1 - t0)
        res_t.append(t2 - t1)
    import resource

    import shutil
    import tempfile

    cli = {}
    out_dir = Path(tempfile.mkdtemp()) / "emit"
    for mode, argv in (("table", ["plan", args.policy, "--model", args.model]),
                       ("--json", ["plan", args.policy, "--model", args.model, "--json"]),
                       ("emit", ["emit", args.policy, "--model", args.model, "--out", str(out_dir)])):
        shutil.rmtree(out_dir, ignore_errors=True)
        # one child per call: ru_maxrss of RUSAGE_CHILDREN is the largest child so far, so run emit last
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "precision_dsl.cli", *argv], check=True, stdout=subprocess.DEVNULL,
                       cwd=ROOT)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        cli[mode] = (time.perf_counter() - t0, cpu, after.ru_maxrss / 1024)
    shutil.rmtree(out_dir.parent, ignore_errors=True)
    print(f"model {args.model}: {len(plan.tensors)} tensors, {arch.total_params / 1e9:.1f}B params")
    print(f"architecture enumeration  min {min(arch_t) * 1e3:7.1f} ms CPU  (of {args.repeat})")
    print(f"plan resolution           min {min(res_t) * 1e3:7.1f} ms CPU  (goal < 1000 ms)")
    print(f"arch + plan               min {min(a + r for a, r in zip(arch_t, res_t)) * 1e3:7.1f} ms CPU")
    goals = {"table": 1000, "--json": 1000, "emit": 3000}
    for mode, (wall, cpu, rss) in cli.items():
        print(f"whole CLI call ({mode:6s})      {wall * 1e3:7.1f} ms wall, {cpu * 1e3:7.1f} ms CPU, max RSS so far "
              f"{rss:5.0f} MB (fresh process, imports included; goal < {goals[mode]} ms CPU)")
    print(f"load average during the run: {os.getloadavg()}")


if __name__ == "__main__":
    main()
