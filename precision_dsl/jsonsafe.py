"""Bounded JSON for files we did not write: safetensors headers, index files, config.json, resume markers.

`json.loads` alone turns hostile input into tracebacks or unbounded work: deep nesting raises RecursionError,
a 5000-digit integer raises a bare ValueError (CPython's int max_str_digits), and a huge-but-legal integer flows into
shape arithmetic. `loads_bounded` turns every one of those into the caller's error type (with the file named and
the content never echoed), and `check_depth` bounds nesting after the fact for the readers whose schema is flat.
"""

from __future__ import annotations

import json
from typing import Any, Callable

MAX_DEPTH = 64  # a safetensors header is 3 levels deep, a HF config.json rarely more than 5
MAX_INT = 1 << 63  # anything larger cannot be a size, offset or count in a file we read


def loads_bounded(data: bytes | str, where: str, error: Callable[[str], Exception], *, max_bytes: int,
                  max_depth: int = MAX_DEPTH) -> Any:
    """Parse `data` as JSON or raise `error(message)` naming `where`. Never echoes the content."""
    if len(data) > max_bytes:
        raise error(f"{where}: {len(data)} bytes of JSON exceeds the {max_bytes}-byte limit")
    try:
        obj = json.loads(data, parse_constant=_no_constant, object_pairs_hook=_unique)
    except _Duplicate as err:
        raise error(f"{where}: key {str(err)[:120]!r} appears twice in one JSON object") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise error(f"{where}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    except (UnicodeDecodeError, ValueError) as err:  # huge integers, NaN/Infinity, bad encodings
        reason = "not UTF-8" if isinstance(err, UnicodeDecodeError) else _int_reason(err)
        raise error(f"{where}: not valid JSON ({reason})") from None
    check_depth(obj, where, error, max_depth)
    return obj


class _Duplicate(Exception):
    pass


def _unique(pairs: list) -> dict:
    # Duplicate keys are legal JSON but ambiguous (json keeps the last, the safetensors library refuses the file):
    # refuse them everywhere, so two readers can never disagree about what a file says.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


def _no_constant(name: str):
    raise ValueError(f"JSON constant {name} is not allowed")


def _int_reason(err: ValueError) -> str:
    text = str(err)
    if "integer" in text and "digits" in text:
        return "an integer literal has too many digits"
    return text[:80] if "constant" in text else "malformed value"


def check_depth(obj: Any, where: str, error: Callable[[str], Exception], max_depth: int = MAX_DEPTH) -> None:
    """Iteratively bound nesting depth and integer size (no recursion, so no RecursionError on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            if d > max_depth:
                raise error(f"{where}: JSON nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            if d > max_depth:
                raise error(f"{where}: JSON nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in x)
        elif isinstance(x, int) and not isinstance(x, bool) and not -MAX_INT <= x <= MAX_INT:
            raise error(f"{where}: integer out of range (more than 64 bits)")
