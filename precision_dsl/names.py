"""Tensor names as the terminal shows them: runs of layer and expert indices collapsed into ranges."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Iterable

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")  # a dotted numeric component: a layer or an expert index


def index_ranges(nums: Iterable[int]) -> str:
    """"0-2,5,7-9" for {0, 1, 2, 5, 7, 8, 9}; "" for none."""
    nums = sorted(set(nums))
    if not nums:
        return ""
    out, start, prev = [], nums[0], nums[0]
    for n in nums[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(out)


def collapse_names(names: list[str], brace_single: bool = True) -> list[tuple[str, int]]:
    """(pattern, count) per name shape, its indices collapsed: model.layers.{3-50}.mlp.experts.{0-255}.gate_proj.weight.
    brace_single=False leaves a single index bare (model.layers.3.mlp...)."""
    pat: "OrderedDict[str, list[tuple[int, ...]]]" = OrderedDict()
    for n in names:
        pat.setdefault(_INDEX.sub("#", n), []).append(tuple(int(x) for x in _INDEX.findall(n)))
    out = []
    for key, idx in pat.items():
        text = key
        for pos in range(key.count("#")):
            r = index_ranges(i[pos] for i in idx)
            text = text.replace("#", r if r.isdigit() and not brace_single else "{" + r + "}", 1)
        out.append((text, len(idx)))
    return out
