"""Behaviour stays byte-identical: plan hashes and byte accounting of every shipped policy x bundled model, the
artifacts `policyc emit` writes for tiny-moe, and the converter's output files for the bundled tiny-moe checkpoint,
against the recorded figures (tests/data/baseline_hashes.json, written by tests/baseline.py)."""

from __future__ import annotations

import json

import baseline

RECORDED = json.loads(baseline.DATA.read_text())


def _same(part: str, got: dict) -> None:
    want = RECORDED[part]
    diff = [f"{k}: recorded {want.get(k)!r}, now {got.get(k)!r}" for k in sorted(set(got) | set(want))
            if got.get(k) != want.get(k)]
    assert len(want) > 10 and not diff, f"{part}:\n" + "\n".join(diff[:10])


def test_plan_hashes_and_bytes_unchanged():
    hashes, sizes = baseline.plan_figures()
    _same("plan_hashes", hashes)
    _same("plan_bytes", sizes)


def test_emitted_artifacts_unchanged():
    _same("emitted", baseline.emitted())


def test_converter_outputs_unchanged():
    _same("converted", baseline.converted())
