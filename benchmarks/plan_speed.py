"""CPU time of `policyc plan` for the largest bundled model (DeepSeek-V3, ~46k tensors).

    python benchmarks/plan_speed.py [--repeat 3] [--against /path/to/other/checkout] [--policy P] [--model M]

Prints: architecture enumeration time, resolution time (in process, this checkout), and the CPU time (user + sys)
and peak RSS of the whole CLI calls `policyc plan`, `plan --json` and `emit` in fresh processes including imports
(the targets: plan --json < 1 s CPU, emit < 3 s CPU on the 2-core machine), each the minimum of --repeat runs.
`--against DIR` runs the same CLI calls from another checkout too, alternating with this one's runs, and prints
the ratios (the side-by-side comparison the guide asks for: both see the same machine load).
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


def _child(argv: list[str], cwd: Path) -> tuple[float, float, float]:
    """(wall s, CPU s = user + sys, peak RSS MB) of one `python -m precision_dsl.cli ...` child run in `cwd`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "precision_dsl.cli", *argv], stdout=subprocess.DEVNULL, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed in {cwd} (exit {proc.returncode})")
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default=str(ROOT / "policies" / "nvfp4-pertoken-dequant-backward.policy"))
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--against", type=Path, default=None, help="another checkout to compare with, run alternately")
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

    import shutil
    import tempfile

    trees = {"this": ROOT} if args.against is None else {"this": ROOT, "other": args.against.resolve()}
    runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    tmp = Path(tempfile.mkdtemp())
    for mode, argv in (("table", ["plan", args.policy, "--model", args.model]),
                       ("--json", ["plan", args.policy, "--model", args.model, "--json"]),
                       ("emit", ["emit", args.policy, "--model", args.model, "--out", str(tmp / "emit")])):
        for _ in range(args.repeat):
            for tree, cwd in trees.items():  # alternate, so that both checkouts see the same load
                shutil.rmtree(tmp / "emit", ignore_errors=True)
                runs.setdefault((mode, tree), []).append(_child(argv, cwd))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"model {args.model}: {len(plan.tensors)} tensors, {arch.total_params / 1e9:.1f}B params")
    print(f"architecture enumeration  min {min(arch_t) * 1e3:7.1f} ms CPU  (of {args.repeat})")
    print(f"plan resolution           min {min(res_t) * 1e3:7.1f} ms CPU  (goal < 1000 ms)")
    print(f"arch + plan               min {min(a + r for a, r in zip(arch_t, res_t)) * 1e3:7.1f} ms CPU")
    goals = {"table": 1000, "--json": 1000, "emit": 3000}
    for (mode, tree), rs in runs.items():
        cpu = min(r[1] for r in rs)
        wall = min(r[0] for r in rs)
        line = (f"whole CLI call ({mode:6s}) {tree:5s} min {cpu * 1e3:7.1f} ms CPU (wall {wall * 1e3:7.1f} ms), "
                f"peak RSS {max(r[2] for r in rs):5.0f} MB")
        if tree == "this":
            line += f"  (fresh process, imports included; goal < {goals[mode]} ms CPU)"
        else:
            line += f"  this/other = {min(r[1] for r in runs[mode, 'this']) / cpu:.2f}"
        print(line)
    print(f"load average during the run: {os.getloadavg()}")


if __name__ == "__main__":
    main()
