"""Behaviour stays byte-identical: plan hashes of every shipped policy x bundled model, the artifacts `policyc emit`
writes for tiny-moe, and the converter's output files for the bundled tiny-moe checkpoint, against the figures
recorded before issue 14's restructure (tests/data/baseline_hashes.json, written by tests/baseline.py)."""

from __future__ import annotations

import json

import pytest

import baseline

RECORDED = json.loads(baseline.DATA.read_text())


def _diff(got: dict, want: dict) -> list[str]:
    return [f"{k}: recorded {want.get(k)!r}, now {got.get(k)!r}" for k in sorted(set(got) | set(want))
            if got.get(k) != want.get(k)]


@pytest.mark.parametrize("part", ["plan_hashes", "emitted", "converted"])
def test_behaviour_unchanged(part):
    got = getattr(baseline, part)()
    assert got, part
    assert not _diff(got, RECORDED[part]), "\n".join(_diff(got, RECORDED[part])[:10])
