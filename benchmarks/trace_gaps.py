"""Where a weight update's GPU is idle: the gaps between kernels in a torch-profiler chrome trace.

    python benchmarks/trace_gaps.py TRACE.json [TRACE.json ...] [--top 12]

For each trace (benchmarks/weight_update_gpu.py --trace DIR writes one per row): per stream, its kernels' count,
busy time and first / last timestamps; then the update's GPU span, the union of busy intervals over every stream,
and the largest idle gaps (no kernel, memset or memcpy running on any stream) with the activity that ends before and
starts after each. Times in microseconds from the first GPU activity.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memset", "gpu_memcpy"}


def gpu_events(trace: dict) -> list:
    """[(start us, end us, stream, name)] of the trace's GPU activity, sorted by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        stream = e.get("args", {}).get("stream", e.get("tid"))
        out.append((ts, ts + dur, stream, e.get("name", "?")))
    return sorted(out)


def gaps(events: list) -> tuple:
    """(busy us, [(gap us, at us, name before, name after)]) over the union of every stream's intervals."""
    busy, gs = 0.0, []
    cs, ce, last = events[0][0], events[0][1], events[0][3]
    for s, e, _st, name in events[1:]:
        if s > ce:
            busy += ce - cs
            gs.append((s - ce, ce, last, name))
            cs, ce, last = s, e, name
        elif e > ce:
            ce, last = e, name
    busy += ce - cs
    return busy, gs


def report(path: Path, top: int) -> None:
    ev = gpu_events(json.loads(path.read_text()))
    if not ev:
        print(f"{path.name}: no GPU activity")
        return
    t0 = ev[0][0]
    span = max(e for _, e, _, _ in ev) - t0
    busy, gs = gaps(ev)
    print(f"== {path.name}: {len(ev)} GPU activities, span {span:.1f} us, busy {busy:.1f} us, idle {span - busy:.1f} us "
          f"in {len(gs)} gaps")
    streams: dict = {}
    for s, e, st, _ in ev:
        streams.setdefault(st, []).append((s, e))
    for st, iv in sorted(streams.items(), key=lambda kv: kv[1][0][0]):
        print(f"   stream {st}: {len(iv)} activities, {sum(e - s for s, e in iv):.1f} us busy, "
              f"from {iv[0][0] - t0:.1f} to {max(e for _, e in iv) - t0:.1f} us")
    for g, at, before, after in sorted(gs, reverse=True)[:top]:
        print(f"   gap {g:6.1f} us at {at - t0:8.1f}: after {before[:60]} | before {after[:60]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for p in args.traces:
        report(p, args.top)


if __name__ == "__main__":
    main()
