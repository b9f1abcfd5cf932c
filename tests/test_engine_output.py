"""What `policyc run` / `ablate` print: wide when piped, one numerics note, no spread for one seed, medians for
times, flags without a value placeholder in --help."""

from __future__ import annotations

import pytest
from conftest import StrictCliRunner

from precision_dsl.cli import app

runner = StrictCliRunner()


def test_one_seed_shows_no_spread():
    from precision_dsl.engine.ablate import mean_spread

    assert mean_spread([0.5]) == "0.500"
    assert mean_spread([0.5, 0.7]) == "0.600±0.141"


def test_the_numerics_note_is_printed_once_per_kind_of_run():
    from precision_dsl.engine.ablate import run_notes
    from precision_dsl.engine.report import numerics_note

    runs = [{"emulated_formats": ["MXFP8"], "rollout_numerics": "independent", "gemm_paths": {"reference": 10 + i},
             "note": numerics_note(("MXFP8",), "independent", {"reference": 10 + i})} for i in range(6)]
    notes = run_notes({"a": runs[:3], "b": runs[3:]})
    assert len(notes) == 1 and "MXFP8 is emulated" in notes[0], notes
    assert "reference 10" not in notes[0]


def test_seconds_per_step_is_the_median_step():
    from precision_dsl.engine.ablate import median_step_s

    recs = [{"time_rollout_s": 1.0, "time_train_s": 1.0, "time_weight_update_s": 0.0}] * 4 \
        + [{"time_rollout_s": 60.0, "time_train_s": 0.0, "time_weight_update_s": 0.0}]  # one stalled step
    assert median_step_s([recs]) == 2.0


@pytest.mark.parametrize("command", ["plan", "check", "emit", "convert", "verify", "run", "ablate", "arch"])
def test_flags_take_no_value_in_help(command):
    r = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0 and "<bool>" not in r.output, r.output


def test_run_is_wide_when_piped(monkeypatch):
    from precision_dsl.engine import cli as engine_cli

    con = engine_cli.run_console()
    assert not con.is_terminal and con.width >= 160
