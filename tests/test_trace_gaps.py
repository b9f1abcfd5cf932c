"""benchmarks/trace_gaps.py: the idle gaps of a GPU timeline over every stream, from a chrome trace."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("trace_gaps", ROOT / "benchmarks" / "trace_gaps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(events):
    return {"traceEvents": [{"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": st}}
                            for cat, ts, dur, name, st in events]
            + [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1000, "name": "host", "args": {}}]}


def test_gaps_over_every_stream(tmp_path, capsys):
    tg = _module()
    # stream 7: [0, 10) and [40, 50); stream 9: [5, 30) overlapping the first; a memset [60, 61)
    tr = _trace([("kernel", 0, 10, "a", 7), ("kernel", 5, 25, "b", 9), ("kernel", 40, 10, "c", 7),
                 ("gpu_memset", 60, 1, "m", 7)])
    ev = tg.gpu_events(tr)
    assert [e[3] for e in ev] == ["a", "b", "c", "m"]  # the host event is not GPU activity
    busy, gaps = tg.gaps(ev)
    assert busy == 30 + 10 + 1
    assert [(g, at, before, after) for g, at, before, after in gaps] == [(10, 30, "b", "c"), (10, 50, "c", "m")]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(tr))
    tg.report(p, top=1)
    out = capsys.readouterr().out
    assert "span 61.0 us, busy 41.0 us, idle 20.0 us in 2 gaps" in out and out.count("gap ") == 1
