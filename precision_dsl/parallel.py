"""Parsing of the `--parallel` option shared by `check`, `plan`, `emit` and `run --engine miles`.

Syntax (sides separated by whitespace or ';'; keys tp, etp, ep, pp; omitted keys default to 1, except the rollout
etp, which defaults to what SGLang derives from the launch args: moe_tp = tp / ep):

    trainer:tp=2,etp=1,ep=8,pp=2 rollout:tp=8,ep=8
    tp=4,ep=8                      # no side prefix: the same layout for trainer and rollout
"""

from __future__ import annotations

import re

from .plan import ParallelLayout, ParallelSide
from .errors import PolicycError

_KEYS = ("tp", "etp", "ep", "pp")
MAX_DEGREE = 65_536  # far above any real deployment; bounds every product the checks compute


class ParallelSpecError(PolicycError, ValueError):
    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _parse_side(text: str, where: str) -> ParallelSide:
    values: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([a-z]+)\s*=\s*(\d+)", item)
        if not m:
            raise ParallelSpecError(f"cannot read '{item[:80]}' in the {where} layout",
                                    "write key=value pairs, e.g. tp=2,etp=1,ep=8,pp=2")
        if len(m.group(2)) > 7:  # before int(): a 5000-digit number is a ValueError in CPython, not a size
            raise ParallelSpecError(f"{m.group(1)} in the {where} layout is out of range (1..{MAX_DEGREE})")
        key, val = m.group(1), int(m.group(2))
        if key not in _KEYS:
            raise ParallelSpecError(f"unknown parallel dimension '{key}' in the {where} layout",
                                    f"known dimensions: {', '.join(_KEYS)}")
        if not 1 <= val <= MAX_DEGREE:
            raise ParallelSpecError(f"{key}={val} in the {where} layout is out of range (1..{MAX_DEGREE})")
        if key in values:
            raise ParallelSpecError(f"{key} given twice in the {where} layout")
        values[key] = val
    return ParallelSide(**values)


def parse_parallel(spec: str | None) -> ParallelLayout | None:
    if spec is None or not spec.strip():
        return None
    parts = [p for p in re.split(r"[\s;]+", spec.strip()) if p]
    explicit_rollout_etp = False
    sides: dict[str, ParallelSide] = {}
    for part in parts:
        if ":" in part:
            side, body = part.split(":", 1)
            side = side.strip().lower()
            if side not in ("trainer", "rollout"):
                raise ParallelSpecError(f"unknown side '{side}' in --parallel",
                                        "use trainer:... and/or rollout:...")
            if side in sides:
                raise ParallelSpecError(f"side '{side}' given twice in --parallel")
            sides[side] = _parse_side(body, side)
            explicit_rollout_etp |= side == "rollout" and re.search(r"(^|,)\s*etp\s*=", body) is not None
        else:
            if sides:
                raise ParallelSpecError(f"'{part}' has no side prefix", "prefix each part with trainer: or rollout:")
            both = _parse_side(part, "trainer/rollout")
            sides = {"trainer": both, "rollout": both}
            explicit_rollout_etp = re.search(r"(^|,)\s*etp\s*=", part) is not None
    rollout = sides.get("rollout", ParallelSide())
    if not explicit_rollout_etp and rollout.ep and rollout.tp % rollout.ep == 0:
        # SGLang has no expert-TP flag: it derives moe_tp_size = tp // ep (// moe_dp); an omitted rollout etp is that
        rollout = rollout.model_copy(update={"etp": rollout.tp // rollout.ep})
    return ParallelLayout(trainer=sides.get("trainer", ParallelSide()), rollout=rollout)


def format_parallel(layout: ParallelLayout) -> str:
    def side(s: ParallelSide) -> str:
        return ",".join(f"{k}={getattr(s, k)}" for k in _KEYS)

    return f"trainer:{side(layout.trainer)} rollout:{side(layout.rollout)}"
