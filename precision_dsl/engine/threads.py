"""How many torch intra-op threads `policyc run` uses: the cores this process may really use now.

torch's default is every core it sees. On a shared box that oversubscribes: with two cores and other jobs
running, OpenMP's barriers made a run 6-15x slower than one thread. `choose_threads` is the pure rule;
`available_threads` reads its inputs (CPU affinity, load average, the cgroup CPU quota) where readable.
`POLICYC_THREADS=N` overrides the choice.
"""

from __future__ import annotations

import math
import os
from typing import Optional


def choose_threads(cpus: int, load: Optional[float] = None, quota: Optional[float] = None) -> int:
    """Threads for `cpus` cores this process may run on (its affinity), `quota` cores granted by a cgroup CPU
    limit (None: no limit) and `load` runnable tasks of others (the 1-minute load average, taken before the run
    starts; None: unknown): the cores not already busy, at least 1."""
    usable = max(1, cpus)
    if quota is not None and quota > 0:
        usable = min(usable, max(1, math.floor(quota)))
    if load is not None and load > 0:
        usable = min(usable, max(1, math.floor(usable - load + 0.5)))  # round: a load of 0.3 leaves the core free
    return usable


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> Optional[float]:
    """Cores granted by the cgroup CPU limit (v2 cpu.max, else v1 cfs quota/period); None without a limit."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_threads() -> tuple[int, str]:
    """(threads, why) for this process now; POLICYC_THREADS wins when set to a positive integer."""
    forced = os.environ.get("POLICYC_THREADS", "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced), "POLICYC_THREADS"
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        load: Optional[float] = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    quota = cgroup_cpu_quota()
    why = f"{cpus} usable core(s)" + (f", cgroup quota {quota:g}" if quota else "") + \
          (f", load {load:.1f}" if load is not None else "")
    return choose_threads(cpus, load, quota), why
