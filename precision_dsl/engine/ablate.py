"""`policyc ablate`: several policies x seeds (+ broken-contract runs) -> one figure + a table, like the MXFP8/NVFP4
RL blog's ablation (reward per config, train-rollout mismatch per config against BF16, phase times).

Runs execute one after the other (`jobs=1`) or in `jobs` spawned processes (each run is independent and seeded, so
the numbers do not depend on `jobs`; only the phase times do: concurrent runs share the CPU cores / the GPU).
Progress is shown while it runs: a live bar over all steps of all runs on a terminal, one line per finished run and
every ~10% otherwise (logs, CI).

An ablation is resumable: `out/ablation.json` records its runs' configurations, every run checkpoints itself
(resume.py), and the same command run again keeps the finished runs, resumes the interrupted ones after their last
checkpoint and starts the rest.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional, Sequence

MISMATCH_BOUND = {"independent": 5e-2, "mirror": 2e-3}  # documented bound for consistent contracts (tests)
PLAN_FILE = "ablation.json"
CHECKPOINT_EVERY_S = 10.0


def _label(policy: str, broken: Optional[str]) -> str:
    from .plans import policy_path

    name = policy_path(policy).stem
    return f"{name} (broken {broken})" if broken else name


def _run_dir(out: Path, label: str, seed: int) -> Path:
    return out / (label.replace(" (broken ", "__broken-").replace(")", "") + f"-s{seed}")


def _resume_state(cfg) -> Optional[dict]:
    """The checkpoint of an interrupted run of exactly this configuration in cfg.out, or None (start afresh)."""
    from . import resume

    try:
        meta = resume.read_state(cfg.out)
    except resume.ResumeError:
        return None
    return meta if meta is not None and resume.mismatch(meta, cfg) is None else None


def _one_run(cfg_json: str, run_dir: str, label: str, queue, threads: int) -> tuple[str, dict]:
    """Worker body (also used in-process for jobs=1): run (resuming the run's checkpoint, if any), write the run
    directory, report every step."""
    import os

    import torch

    from . import resume
    from .loop import RunConfig, run
    from .report import run_summary, write_run

    if threads:
        torch.set_num_threads(threads)
    cfg = RunConfig.model_validate_json(cfg_json).model_copy(update={"out": Path(run_dir)})
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    state = _resume_state(cfg)
    queue.put(("started", os.getpid(), state["step"] if state else 0))
    try:
        res = run(cfg, on_step=lambda m: queue.put((label, cfg.seed, m.step, m.reward_mean, m.mismatch_abs_logp)),
                  resume_state=state)
        write_run(res, Path(run_dir))
        resume.finish(Path(run_dir))
    finally:
        queue.put(("ended", os.getpid(), 0))
    return label, run_summary(res)


def _finished(run_dir: Path, cfg) -> Optional[dict]:
    """The summary of a run of this configuration that an earlier invocation finished, or None."""
    import json

    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    same = (s.get("steps") == cfg.steps and s.get("seed") == cfg.seed and not (run_dir / "resume").exists())
    return s if same else None


class _Progress:
    """Live progress over all runs (rich bar on a terminal; plain lines otherwise)."""

    def __init__(self, con, total_steps: int, n_runs: int):
        import time

        self.con, self.total, self.n_runs = con, total_steps, n_runs
        self.done_steps, self.done_runs, self.t0, self.next_pct = 0, 0, time.perf_counter(), 10
        self.bar = None
        if con.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]ablate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"), console=con)
            self.bar.start()
            self.task = self.bar.add_task("ablate", total=total_steps, info="starting")

    def skip(self, steps: int) -> None:
        """Steps that an earlier, interrupted invocation already ran (a finished or checkpointed run)."""
        self.done_steps += steps
        if self.bar is not None:
            self.bar.update(self.task, advance=steps)

    def step(self, label: str, seed: int, step: int, reward: float, mismatch: float) -> None:
        import time

        self.done_steps += 1
        info = f"{label} s{seed} step {step}: reward {reward:.2f} |Δlogp| {mismatch:.1e}"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        elif 100 * self.done_steps >= self.next_pct * self.total:
            self.con.print(f"[{time.perf_counter() - self.t0:.0f}s] {100 * self.done_steps // self.total}% of "
                           f"steps · {self.done_runs}/{self.n_runs} runs done · last: {info}", markup=False)
            self.next_pct += 10

    def run_done(self, label: str, s: dict) -> None:
        self.done_runs += 1
        msg = (f"done {self.done_runs}/{self.n_runs}: {label} seed {s['seed']} reward {s['reward_start']:.2f} -> "
               f"{s['reward_end']:.2f}, mean |Δlogp| {s['mismatch_abs_logp_mean']:.2e}")
        (self.bar.console if self.bar is not None else self.con).print(msg, markup=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _configs(policies: Sequence[str], broken_contract: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    from .plans import DEFAULT_POLICY

    configs: list[tuple[str, Optional[str]]] = [(p, None) for p in policies]
    for broken in broken_contract:
        nvfp4 = [p for p in policies if "nvfp4" in p]
        target = next((p for p in nvfp4 if DEFAULT_POLICY in p), nvfp4[0] if nvfp4 else policies[-1])
        configs.append((target, broken))
    return configs


def _claim(out: Path, plan: list, fresh: bool) -> bool:
    """Record this ablation's runs in out/ablation.json; True when `out` holds an interrupted ablation of the same
    runs (resume it). Another ablation there is refused unless `fresh` (--overwrite: start over)."""
    import json

    from . import resume
    from .metrics import write_json_atomic

    want = {"version": 1, "runs": [{"dir": _run_dir(out, label, seed).name, "config": resume.config_key(cfg)}
                                   for label, seed, cfg in plan]}
    path = out / PLAN_FILE
    have = None
    if path.is_file():
        try:
            have = json.loads(path.read_text())
        except (OSError, ValueError):
            have = "unreadable"
    if have is not None and have != want and not fresh:
        raise resume.ResumeError(f"{out} holds {'an unreadable' if have == 'unreadable' else 'another'} ablation "
                        f"({PLAN_FILE} lists other runs)", "pass the same arguments to resume it, a new --out, "
                        "or --overwrite to start over")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, want)
    return have == want and not fresh


def ablate(policies: Sequence[str], *, seeds: int, steps: int, out: Path,
           broken_contract: Sequence[str] | str | None = (), device: str = "cpu", prompts: int = 16,
           lr: float = 3e-4, quiet: bool = False, model: str = "tiny-moe", task: str = "arithmetic", digits: int = 2,
           jobs: int = 1, rollout_numerics: str = "independent", routing_replay: bool = False,
           fresh: bool = False, again: str = "re-run the same command") -> dict:
    """fresh: start every run over (ignore finished runs and checkpoints of an earlier invocation). again: what the
    user runs to resume, for the message of an interrupt."""
    from rich.console import Console

    from . import resume
    from .loop import RunConfig

    if isinstance(broken_contract, str):
        broken_contract = [broken_contract]
    con = Console(stderr=True, highlight=False, quiet=quiet)
    plan: list[tuple[str, int, RunConfig]] = []
    # seed-major order: an ablation cut short still has every config, with fewer seeds
    for seed in range(seeds):
        for policy, broken in _configs(policies, broken_contract or ()):
            plan.append((_label(policy, broken), seed, RunConfig(
                policy=policy, model=model, task=task, digits=digits, steps=steps, seed=seed, device=device,
                prompts_per_step=prompts, lr=lr, broken_contract=broken, rollout_numerics=rollout_numerics,
                routing_replay=routing_replay, checkpoint_every_s=CHECKPOINT_EVERY_S)))
    resuming = _claim(out, plan, fresh)
    con.print(f"ablate: {len(plan)} runs ({len(plan) // seeds} configs x {seeds} seeds) x {steps} steps on {model} "
              f"({device}, {jobs} at a time)", markup=False)
    progress = _Progress(con, len(plan) * steps, len(plan))
    summaries: dict[str, list[dict]] = {}
    for label, _, _ in plan:
        summaries.setdefault(label, [])
    todo = []
    for label, seed, cfg in plan:
        run_dir = _run_dir(out, label, seed)
        if fresh:
            resume.finish(run_dir)  # an earlier checkpoint there must not be resumed into this ablation
        done = _finished(run_dir, cfg) if resuming else None
        if done is not None:
            summaries[label].append(done)
            progress.skip(steps)
            progress.run_done(label, done)
        else:
            todo.append((label, seed, cfg))
    if resuming:
        con.print(f"resuming {out}: {len(plan) - len(todo)} of {len(plan)} runs already finished", markup=False)
    try:
        if jobs == 1:
            class _Direct:  # in-process "queue": report straight to the progress display
                def put(self, item):
                    if item[0] == "started":
                        progress.skip(item[2])
                    elif item[0] != "ended":
                        progress.step(*item)

            direct = _Direct()
            for label, seed, cfg in todo:
                _, s = _one_run(cfg.model_dump_json(), str(_run_dir(out, label, seed)), label, direct, 0)
                summaries[label].append(s)
                progress.run_done(label, s)
        else:
            _parallel(todo, out, jobs, device, progress, summaries)
    except KeyboardInterrupt as err:
        finished = sum(len(v) for v in summaries.values())
        checkpointed = sum(1 for label, seed, cfg in todo
                           if ((_resume_state(cfg.model_copy(update={"out": _run_dir(out, label, seed)})) or {})
                               .get("step") or 0) > 0)
        err.resume = (f"{finished} of {len(plan)} runs are finished in {out}"
                      + (f", {checkpointed} checkpointed" if checkpointed else "")
                      + f"; {again} to resume")  # console.guard prints it after "interrupted"
        raise
    finally:
        progress.close()
    return summarize(out, summaries, seeds=seeds, steps=steps, model=model, quiet=quiet, jobs=jobs,
                     rollout_numerics=rollout_numerics)


def _parallel(plan, out: Path, jobs: int, device: str, progress: _Progress, summaries: dict) -> None:
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    manager = ctx.Manager()
    q = manager.Queue()
    threads = 1 if device == "cpu" else max(1, (os.cpu_count() or 2) // jobs)
    try:
        _run_pool(plan, out, jobs, ctx, q, threads, progress, summaries)
    finally:
        manager.shutdown()  # also after a failed or interrupted run: the manager is a process of its own


def _run_pool(plan, out: Path, jobs: int, ctx, q, threads: int, progress: _Progress, summaries: dict) -> None:
    import os
    import queue as _q
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending = {pool.submit(_one_run, cfg.model_dump_json(), str(_run_dir(out, label, seed)), label, q, threads)
                   for label, seed, cfg in plan}
        running: set = set()  # pids of the workers inside a run
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                while True:
                    try:
                        item = q.get_nowait()
                    except _q.Empty:
                        break
                    if item[0] == "started":
                        running.add(item[1])
                        progress.skip(item[2])
                    elif item[0] == "ended":
                        running.discard(item[1])
                    else:
                        progress.step(*item)
                for f in done:
                    label, s = f.result()  # a failed run raises here, with its own message
                    summaries[label].append(s)
                    progress.run_done(label, s)
        except KeyboardInterrupt:
            # a Ctrl-C on the terminal reaches every worker too; a SIGINT to this process alone is passed on to
            # the workers inside a run (each stops at its next statement, its checkpoint intact), and the runs not
            # yet started are dropped, so the pool's shutdown does not run them
            import signal

            for f in pending:
                f.cancel()
            for pid in running:
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:
                    pass
            raise


def summarize_dir(out: Path, *, quiet: bool = False, jobs: int = 1) -> dict:
    """Summarize the finished runs found under `out` (e.g. after an ablation was cut short): every `*/summary.json`."""
    import json

    summaries: dict[str, list[dict]] = {}
    meta = {}
    for f in sorted(Path(out).glob("*/summary.json")):
        s = json.loads(f.read_text())
        stem = f.parent.name.rsplit("-s", 1)[0]
        label = stem.replace("__broken-", " (broken ") + (")" if "__broken-" in stem else "")
        summaries.setdefault(label, []).append(s)
        meta = s
    if not summaries:
        raise FileNotFoundError(f"{out}: no finished runs (*/summary.json)")
    seeds = max(len(v) for v in summaries.values())
    return summarize(out, summaries, seeds=seeds, steps=meta["steps"], model=meta.get("model", "tiny-moe"),
                     quiet=quiet, jobs=jobs, rollout_numerics=meta.get("rollout_numerics", "independent"))


def mean_spread(values: Sequence[float]) -> str:
    """`mean±std` over seeds; one seed has no spread to show (a ±0.000 would read as a measured one)."""
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) < 2 else f"{mean:.3f}±{statistics.stdev(values):.3f}"


def median_step_s(runs: Sequence[Sequence[dict]]) -> float:
    """Median wall time of one step (all phases) over every step of every run: one stalled step (a busy machine,
    a first-call compile) moves a mean, not the median."""
    from .plots import PHASES

    return statistics.median(sum(r[key] for key, _ in PHASES) for recs in runs for r in recs)


def run_notes(summaries: dict[str, list[dict]]) -> list[str]:
    """What the runs' numbers are, once per kind of run (formats emulated x rollout numerics), without each run's
    own GEMM call counts (those stay in its summary.json)."""
    from .report import numerics_note

    notes = set()
    for ss in summaries.values():
        for s in ss:
            if "emulated_formats" in s:
                formats = s["emulated_formats"]
                notes.add(numerics_note(True if formats is None else tuple(formats),
                                        s.get("rollout_numerics", "independent")))
            else:  # a summary written before it recorded its formats
                notes.add(s["note"])
    return sorted(notes)


def summarize(out: Path, summaries: dict[str, list[dict]], *, seeds: int, steps: int, model: str,
              quiet: bool = False, jobs: int = 1, rollout_numerics: str = "independent") -> dict:
    """Table + figure + ablation.json from the run directories' summaries (re-runnable on a finished ablation)."""
    from rich.console import Console
    from rich.table import Table

    from .metrics import read_jsonl, write_json_atomic
    from .plots import plot_ablation

    con = Console(stderr=True, highlight=False, quiet=quiet)
    runs = {label: [read_jsonl(_run_dir(out, label, s["seed"]) / "metrics.jsonl")
                    for s in sorted(ss, key=lambda s: s["seed"])] for label, ss in summaries.items()}
    bound = MISMATCH_BOUND.get(rollout_numerics)
    name = Path(model).name
    fig = plot_ablation(runs, out / "ablation.png",
                        f"{name} GRPO ablation ({seeds} seed(s), {steps} steps; rollout numerics: {rollout_numerics})",
                        mismatch_bound=bound, concurrent=jobs > 1)
    bf16 = summaries.get("bf16")
    bf16_mis = statistics.fmean(s["mismatch_abs_logp_mean"] for s in bf16) if bf16 else None
    rows = []
    table = Table(title="final reward (mean of last steps) and train-rollout mismatch")
    for col in ("config", "reward start", "reward end mean±std", "mean |Δlogp|", "× BF16", "k3 KL(rollout‖train)",
                "KL vs BF16 ref", "routing differs", "grad spikes", "s/step (median)"):
        table.add_column(col)
    for label, ss in summaries.items():
        ss = sorted(ss, key=lambda s: s["seed"])
        ends = [s["reward_end"] for s in ss]
        routing = [s["routing_disagreement_mean"] for s in ss if s.get("routing_disagreement_mean") is not None]
        row = {
            "config": label,
            "reward_start": statistics.fmean(s["reward_start"] for s in ss),
            "reward_end_mean": statistics.fmean(ends),
            "reward_end_std": statistics.stdev(ends) if len(ends) > 1 else 0.0,
            "reward_end_per_seed": ends,
            "mismatch_abs_logp": statistics.fmean(s["mismatch_abs_logp_mean"] for s in ss),
            "mismatch_abs_logp_per_seed": [s["mismatch_abs_logp_mean"] for s in ss],
            "mismatch_k3": statistics.fmean(s["mismatch_k3_mean"] for s in ss),
            "kl_ref_k3_end": statistics.fmean(s["kl_ref_k3_end"] for s in ss),
            "routing_disagreement": statistics.fmean(routing) if routing else None,
            "grad_spikes": sum(s["grad_spikes"] for s in ss),
            "weights_identical_every_step": all(s["quantized_weights_identical_every_step"] for s in ss),
            "s_per_step": median_step_s(runs[label]),
        }
        row["mismatch_vs_bf16"] = row["mismatch_abs_logp"] / bf16_mis if bf16_mis else None
        rows.append(row)
        table.add_row(label, f"{row['reward_start']:.3f}", mean_spread(ends),
                      f"{row['mismatch_abs_logp']:.2e}",
                      "-" if row["mismatch_vs_bf16"] is None else f"{row['mismatch_vs_bf16']:.2f}",
                      f"{row['mismatch_k3']:.2e}", f"{row['kl_ref_k3_end']:.2e}",
                      "-" if row["routing_disagreement"] is None else f"{row['routing_disagreement']:.2%}",
                      str(row["grad_spikes"]), f"{row['s_per_step']:.2f}")
    out_con = Console(highlight=False, quiet=quiet)
    if not out_con.is_terminal:
        out_con.width = 190  # logs: do not squeeze the table to 80 columns
    out_con.print(table)
    notes = run_notes(summaries)
    for n in notes:
        con.print(n, markup=False, soft_wrap=True)  # one line each: a piped log is not folded at 80 columns
    result = {"seeds": seeds, "steps": steps, "model": model, "rollout_numerics": rollout_numerics,
              "mismatch_bound": bound, "jobs": jobs, "rows": rows, "figure": str(fig), "notes": notes}
    write_json_atomic(out / "ablation.json", result)
    con.print(f"wrote {fig} and {out / 'ablation.json'}", markup=False)
    return result
