"""A resumable `policyc run` (engine/resume.py): an interrupted run continues after its last checkpoint with the
metrics an uninterrupted run has, bit for bit; what cannot be resumed is refused by name, never with a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import StrictCliRunner
from precision_dsl.cli import app
from precision_dsl.engine import resume
from precision_dsl.engine.loop import RunConfig, run

REPO = Path(__file__).resolve().parents[1]
runner = StrictCliRunner()
TIMING = ("time_rollout_s", "time_train_s", "time_reference_s", "time_weight_update_s", "rollout_tokens_per_s")


def _flat(text: str) -> str:
    """The console wraps long lines (paths): compare with every run of whitespace as one space."""
    return " ".join(text.split())


def _numbers(steps) -> list[dict]:
    return [{k: v for k, v in (m if isinstance(m, dict) else m.model_dump()).items() if k not in TIMING}
            for m in steps]


def _cfg(out: Path, steps: int = 5) -> RunConfig:
    return RunConfig(steps=steps, prompts_per_step=2, samples_per_prompt=2, out=out, checkpoint_every_s=0,
                     max_new_tokens=8)


class _StopAfter:
    def __init__(self, step: int):
        self.step = step

    def __call__(self, m):
        if m.step == self.step:
            raise KeyboardInterrupt


def _interrupted_cli_run(monkeypatch, args: list, after: int):
    """`policyc run ARGS` stopped by a Ctrl-C right after step `after` (once its checkpoint is written)."""
    from precision_dsl.engine import loop

    real = loop.run

    def stopping(cfg, on_step=None, **kw):
        def step(m):
            if on_step:
                on_step(m)
            _StopAfter(after)(m)

        return real(cfg, on_step=step, **kw)

    monkeypatch.setattr(loop, "run", stopping)
    r = runner.invoke(app, args)
    monkeypatch.setattr(loop, "run", real)
    return r


def test_a_resumed_run_has_the_metrics_of_an_uninterrupted_one(tmp_path):
    whole = run(_cfg(tmp_path / "whole"))
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(out), on_step=_StopAfter(3))  # step 3's checkpoint is written before on_step sees it
    state = resume.read_state(out)
    assert state["step"] == 3 and (out / "resume" / state["tensors"]).is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    again = run(_cfg(out), resume_state=state)
    assert again.resumed_from_step == 3 and [m.step for m in again.steps] == [1, 2, 3, 4, 5]
    assert _numbers(again.steps) == _numbers(whole.steps)  # rewards, log-probs, grad norms: every bit
    assert again.gemm_paths == whole.gemm_paths and again.train_gemm_flops == whole.train_gemm_flops
    assert again.rollout_gemm_paths == whole.rollout_gemm_paths
    assert _numbers(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) == \
        _numbers(whole.steps)


def test_steps_after_the_checkpoint_are_dropped_and_run_again(tmp_path):
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(out), on_step=_StopAfter(2))
    state = resume.read_state(out)
    with (out / "metrics.jsonl").open("a") as f:  # a step that finished after the checkpoint
        f.write(json.dumps({"step": 3}) + "\n")
    again = run(_cfg(out, steps=3), resume_state=state)
    assert [m.step for m in again.steps] == [1, 2, 3] and again.steps[2].reward_mean is not None


def test_checkpoints_are_only_resumed_by_the_same_configuration(tmp_path):
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(out), on_step=_StopAfter(1))
    state = resume.read_state(out)
    assert resume.mismatch(state, _cfg(out)) is None
    assert resume.mismatch(state, _cfg(out).model_copy(update={"checkpoint_every_s": 60.0})) is None
    assert resume.mismatch(state, _cfg(out, steps=9)) == "steps: 5 there, 9 now"
    r = runner.invoke(app, ["run", "--steps", "2", "--prompts", "2", "--samples", "2", "--out", str(out)])
    assert r.exit_code == 2 and "holds an interrupted run of another configuration" in _flat(r.output), r.output
    assert "--overwrite to start over" in _flat(r.output)


ARGS = ["run", "--steps", "3", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--checkpoint-every", "0"]


def test_ctrl_c_says_what_is_kept_and_the_same_command_resumes_the_default_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _interrupted_cli_run(monkeypatch, ARGS, after=1)
    assert r.exit_code == 130, r.output
    assert _flat(r.output).endswith("error: interrupted; steps 1-1 are checkpointed in runs/nvfp4-pertoken-dequant-"
                                    "backward-s0; re-run the same command to resume after step 1"), r.output
    r = runner.invoke(app, ARGS)
    assert r.exit_code == 0, r.output
    assert "resuming runs/nvfp4-pertoken-dequant-backward-s0 after step 1 of 3" in _flat(r.output), r.output
    done = Path("runs/nvfp4-pertoken-dequant-backward-s0")
    assert not (done / "resume").exists() and json.loads((done / "summary.json").read_text())["resumed_from_step"] == 1
    assert len((done / "metrics.jsonl").read_text().splitlines()) == 3
    r = runner.invoke(app, ARGS)  # the finished run is kept; the same command now starts a new one beside it
    assert r.exit_code == 0 and Path("runs/nvfp4-pertoken-dequant-backward-s0-2/summary.json").is_file(), r.output


def test_an_interrupt_during_set_up_starts_the_same_directory_again(tmp_path, monkeypatch):
    from precision_dsl.engine import loop

    out = tmp_path / "run"
    real = loop.load_model
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    r = runner.invoke(app, ARGS + ["--out", str(out)])
    monkeypatch.setattr(loop, "load_model", real)
    assert r.exit_code == 130, r.output
    assert _flat(r.output).endswith(f"error: interrupted; no step was checkpointed yet; re-run the same command "
                                    f"to start again in {out}"), r.output
    r = runner.invoke(app, ARGS + ["--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"starting {out} again (interrupted before its first checkpoint)" in _flat(r.output), r.output


@pytest.mark.parametrize("damage", ["state", "tensors", "metrics"])
def test_a_damaged_checkpoint_is_refused_with_the_way_out(tmp_path, monkeypatch, damage):
    out = tmp_path / "cut"
    args = ARGS + ["--out", str(out)]
    assert _interrupted_cli_run(monkeypatch, args, after=2).exit_code == 130
    state = resume.read_state(out)
    target = {"state": out / "resume" / "state.json", "tensors": out / "resume" / state["tensors"],
              "metrics": out / "metrics.jsonl"}[damage]
    target.write_bytes(target.read_bytes()[: 40 if damage != "metrics" else 10])
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert ("unreadable" in r.output or "holds 0 of the 2" in _flat(r.output)) and "--overwrite" in r.output, \
        r.output
    r = runner.invoke(app, args + ["--overwrite"])  # starting over is always possible
    assert r.exit_code == 0, r.output
    assert not (out / "resume").exists() and len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_the_schedule_keeps_checkpoints_a_small_share_of_the_run():
    s = resume.Schedule(10.0, now=0.0)
    assert not s.due(9.9) and s.due(10.0)
    s.done(started=10.0, now=12.0)  # a 2 s checkpoint: the next one no sooner than 40 s later
    assert not s.due(12.0 + 39.9) and s.due(12.0 + 40.0)


def test_ctrl_c_in_a_real_run_says_what_is_kept_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "precision_dsl.cli", "run", "--steps", "12", "--prompts", "2", "--samples", "2",
           "--max-new-tokens", "8", "--checkpoint-every", "0", "--out", str(out)]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "POLICYC_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while (not metrics.is_file() or len(metrics.read_text().splitlines()) < 2) and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the interrupt landed")
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    last = _flat(stderr)
    assert "error: interrupted; steps 1-" in last and last.endswith(f"re-run the same command to resume after step "
                                                                   f"{resume.read_state(out)['step']}"), last
    kept = resume.read_state(out)["step"]
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming {out} after step {kept} of 12" in _flat(again.stdout + again.stderr)
    assert len(metrics.read_text().splitlines()) == 12 and not (out / "resume").exists()


ABLATE = ["ablate", "bf16", "mxfp8-e2e", "--steps", "2", "--prompts", "2"]


def _interrupted_ablation(monkeypatch, args: list, run_no: int, after: int):
    """`policyc ablate ARGS` stopped by a Ctrl-C after step `after` of its run number `run_no` (from 1)."""
    from precision_dsl.engine import loop

    real, runs = loop.run, []

    def stopping(cfg, on_step=None, **kw):
        runs.append(cfg)

        def step(m):
            if on_step:
                on_step(m)
            if len(runs) == run_no:
                _StopAfter(after)(m)

        return real(cfg, on_step=step, **kw)

    monkeypatch.setattr(loop, "run", stopping)
    try:
        return runner.invoke(app, args)
    finally:
        monkeypatch.setattr(loop, "run", real)


def _summaries(out: Path) -> dict:
    keep = ("reward_start", "reward_end", "mismatch_abs_logp_mean", "kl_ref_k3_end", "gemm_paths")
    return {f.parent.name: {k: json.loads(f.read_text())[k] for k in keep} for f in sorted(out.glob("*/summary.json"))}


@pytest.fixture
def one_thread():
    """--jobs N workers run on one torch thread each: the in-process runs too, so every run reduces the same way."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_interrupted_ablation_resumes_its_runs(tmp_path, monkeypatch, one_thread, jobs):
    whole = tmp_path / "whole"
    assert runner.invoke(app, ABLATE + ["--out", str(whole)]).exit_code == 0
    out = tmp_path / "cut"
    # every run checkpoints after each step here (the default is at most every 10 s)
    monkeypatch.setattr("precision_dsl.engine.ablate.CHECKPOINT_EVERY_S", 0.0)
    r = _interrupted_ablation(monkeypatch, ABLATE + ["--out", str(out)], run_no=2, after=1)
    assert r.exit_code == 130, r.output
    assert _flat(r.output).endswith(f"error: interrupted; 1 of 2 runs are finished in {out}, 1 checkpointed; "
                                    f"re-run the same command to resume"), r.output
    assert resume.read_state(out / "mxfp8-e2e-s0")["step"] == 1
    r = runner.invoke(app, ABLATE + ["--out", str(out), "--jobs", jobs])  # the number of jobs is no setting of a run
    assert r.exit_code == 0, r.output
    assert f"resuming {out}: 1 of 2 runs already finished" in _flat(r.output), r.output
    assert _summaries(out) == _summaries(whole)
    assert json.loads((out / "mxfp8-e2e-s0" / "summary.json").read_text())["resumed_from_step"] == 1
    assert not list(out.glob("*/resume"))


def test_another_ablation_in_the_directory_is_refused_and_overwrite_starts_over(tmp_path, monkeypatch):
    out = tmp_path / "cut"
    assert _interrupted_ablation(monkeypatch, ABLATE + ["--out", str(out)], run_no=1, after=1).exit_code == 130
    r = runner.invoke(app, ["ablate", "bf16", "--steps", "2", "--prompts", "2", "--out", str(out)])
    assert r.exit_code == 2 and "holds another ablation" in _flat(r.output), r.output
    r = runner.invoke(app, ["ablate", "bf16", "--steps", "2", "--prompts", "2", "--out", str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert "resuming" not in r.output and json.loads((out / "bf16-s0" / "summary.json").read_text())[
        "resumed_from_step"] == 0
