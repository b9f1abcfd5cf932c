"""`policyc run` and `policyc ablate`. Only typer at import time: torch & co. load inside the commands."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .report import write_run


def _guard(body):
    from ..console import guard

    return guard(body)


def _run_config(cls, **values):
    """Validate a run's settings once (pydantic); a bad value is a usage error naming the option."""
    from pydantic import ValidationError

    from ..console import UserError

    try:
        return cls(**values)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        option = {"prompts_per_step": "prompts", "samples_per_prompt": "samples",
                  "train_micro_batch": "micro-batch"}.get(field, field)
        raise UserError(f"invalid --{option.replace('_', '-')}: {first['msg']} (got {first.get('input')!r})") from None


def _fresh_out_dir(out: Optional[Path], default_name: str, overwrite: bool) -> Path:
    """A run directory that holds no previous results (never overwrite a user's files silently)."""
    from ..console import UserError

    if out is None:
        base = Path("runs") / default_name
        out, i = base, 2
        while out.exists() and any(out.iterdir()):
            out, i = Path(f"{base}-{i}"), i + 1
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output directory {out} is not empty", "pass a new --out or add --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _resume_state_or_none(out: Path):
    from . import resume

    try:
        return resume.read_state(out)
    except resume.ResumeError:
        return None


def _run_out_dir(out: Optional[Path], default_name: str, overwrite: bool, cfg) -> tuple[Path, Optional[dict]]:
    """The run directory, and the resume state to continue from (None: from the start). An interrupted run of the
    same configuration is resumed: the one in --out, or without --out the first runs/<name>[-k] holding one. An
    --out holding an interrupted run of another configuration is refused; --overwrite starts over."""
    from ..console import UserError
    from . import resume

    if out is None:
        base = Path("runs") / default_name
        cand, i = base, 2
        while cand.exists() and any(cand.iterdir()):
            meta = _resume_state_or_none(cand)
            if meta is not None and resume.mismatch(meta, cfg) is None:
                return cand, meta
            cand, i = Path(f"{base}-{i}"), i + 1
        cand.mkdir(parents=True, exist_ok=True)
        return cand, None
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file", "pass a directory")
    if out.exists() and any(out.iterdir()):
        if overwrite:
            resume.finish(out)  # starting over: the old checkpoint must never be resumed into this run
            return out, None
        meta = resume.read_state(out)
        if meta is None:
            raise UserError(f"output directory {out} is not empty", "pass a new --out or add --overwrite")
        why = resume.mismatch(meta, cfg)
        if why:
            raise UserError(f"{out} holds an interrupted run of another configuration ({why})",
                            "pass the same options to resume it, a new --out, or --overwrite to start over")
        return out, meta
    out.mkdir(parents=True, exist_ok=True)
    return out, None


def _resume_hint(out_dir: Path, overwrite: bool) -> str:
    """What an interrupted `policyc run` says: what is kept and how to go on."""
    meta = _resume_state_or_none(out_dir)
    again = "re-run the same command" + (" without --overwrite" if overwrite else "")
    if meta is None:
        return f"nothing was checkpointed in {out_dir}"
    if meta["step"] == 0:
        return f"no step was checkpointed yet; {again} to start again in {out_dir}"
    return f"steps 1-{meta['step']} are checkpointed in {out_dir}; {again} to resume after step {meta['step']}"


def _step_info(m, window: list[float]) -> str:
    window.append(m.reward_mean)
    avg = sum(window[-10:]) / len(window[-10:])
    ident = "" if m.quantized_weights_identical is None else \
        (" bytes=identical" if m.quantized_weights_identical else f" bytes≠({m.quantized_weights_differing})")
    return (f"reward {m.reward_mean:.2f} (avg10 {avg:.2f})  |Δlogp| {m.mismatch_abs_logp:.1e}  "
            f"KLref {m.kl_ref_k3:.1e}  gnorm {m.grad_norm:.2f}{' SPIKE' if m.grad_spike else ''}  "
            f"rollout {m.rollout_tokens_per_s:.0f} tok/s{ident}")


PROGRESS_EVERY_S = 10.0  # a log without a line for longer reads like a hang


def progress_due(step: int, total: int, since_last_s: float) -> bool:
    """Whether a finished step gets a plain progress line: every 10th, the first and the last, and any step
    PROGRESS_EVERY_S or more after the previous line (slow steps on a busy CPU)."""
    return step % 10 == 0 or step in (1, total) or since_last_s >= PROGRESS_EVERY_S


def use_available_threads() -> str:
    """Set torch's intra-op threads to the cores this process may really use now (engine/threads.py); returns
    the line that says so."""
    import torch

    from .threads import available_threads

    n, why = available_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return f"torch threads: {n} ({why})"


def run_console():
    """stdout of `policyc run`: console.console() (wide when piped, so a log keeps each line whole)."""
    from ..console import console

    return console()


def _live_run(cfg, title: str, resume_state: Optional[dict] = None):
    """Run the loop with a rich progress bar + live metrics on a terminal; one plain line per 10 steps otherwise
    (logs, CI). Returns RunResult."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .loop import run

    con = Console(stderr=True, highlight=False, markup=False)
    window: list[float] = []
    if not con.is_terminal:
        import threading

        t0 = time.perf_counter()
        last = [t0, resume_state["step"] if resume_state else 0]  # time of the last line, last finished step
        lock = threading.Lock()

        def say(text: str) -> None:
            with lock:
                last[0] = time.perf_counter()
                con.print(f"{text} [{last[0] - t0:.0f}s]", soft_wrap=True)

        def on_plain_step(m):
            info = _step_info(m, window)
            last[1] = m.step
            if progress_due(m.step, cfg.steps, time.perf_counter() - last[0]):
                say(f"step {m.step}/{cfg.steps}  {info}")

        stop = threading.Event()

        def heartbeat():  # a line at least every PROGRESS_EVERY_S, also while one long step runs
            while not stop.wait(1.0):
                if time.perf_counter() - last[0] >= PROGRESS_EVERY_S:
                    say(f"step {last[1] + 1}/{cfg.steps} running")

        beat = threading.Thread(target=heartbeat, name="policyc-progress", daemon=True)
        beat.start()
        try:
            return run(cfg, on_step=on_plain_step, resume_state=resume_state)
        finally:
            stop.set()
            beat.join()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=con, transient=False) as prog:
        from rich.markup import escape

        task_id = prog.add_task(escape(title), total=cfg.steps, info="starting",
                                completed=resume_state["step"] if resume_state else 0)

        def on_step(m):
            prog.update(task_id, advance=1, info=_step_info(m, window))

        return run(cfg, on_step=on_step, resume_state=resume_state)


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        policy: Optional[str] = typer.Argument(None, help="policy file or shipped policy name (default: "
                                               "nvfp4-pertoken-dequant-backward; nvfp4-dense on a dense model)"),
        model: str = typer.Option("tiny-moe", "--model", help="bundled model name or HF Qwen3 / Qwen3-MoE directory"),
        task: str = typer.Option("arithmetic", "--task", help="arithmetic | PATH.jsonl (dapo-math style)"),
        steps: int = typer.Option(120, "--steps", min=1),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
        rollout_device: Optional[str] = typer.Option(
            None, "--rollout-device", help="run the rollout engine as a separate process on this device, e.g. "
                                           "cuda:1 (weights over NCCL) or cpu (gloo)"),
        trainer_etp: int = typer.Option(1, "--trainer-etp", min=1, help="expert-TP ranks of the trainer (per-token "
                                        "activation scales are computed per partition)"),
        rollout_etp: int = typer.Option(1, "--rollout-etp", min=1, help="expert-TP ranks of the rollout"),
        force_layout: bool = typer.Option(False, "--force-layout", help="run a layout `policyc check` refuses "
                                          "(e.g. unequal ETP) to measure the mismatch it causes"),
        out: Optional[Path] = typer.Option(None, "--out", help="run directory (default runs/<policy>-s<seed>)"),
        broken_contract: Optional[str] = typer.Option(None, "--broken-contract",
                                                      help="per_tensor | unshared: make the rollout disagree"),
        prompts: int = typer.Option(16, "--prompts", help="prompts per step"),
        samples: int = typer.Option(8, "--samples", help="samples per prompt (GRPO group size)"),
        micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="sequences per trainer micro-batch "
                                                  "(gradients accumulated; bounds activation memory; default: the "
                                                  "whole batch)"),
        lr: float = typer.Option(3e-4, "--lr"),
        kl_coef: float = typer.Option(0.0, "--kl-coef"),
        digits: int = typer.Option(2, "--digits", help="arithmetic: digits per operand"),
        operators: str = typer.Option("+", "--operators", help="arithmetic: subset of '+-*'"),
        engine: str = typer.Option("embedded", "--engine", help="embedded | miles | verl (emit a Miles / verl "
                                   "launch script)"),
        rollout: str = typer.Option("vllm", "--rollout", help="verl: the rollout engine, vllm | sglang"),
        parallel: Optional[str] = typer.Option(None, "--parallel", help="miles: parallel layout, e.g. "
                                               "'trainer:tp=4,ep=8 rollout:tp=8,ep=8'"),
        launch: bool = typer.Option(False, "--launch", help="miles: execute the script (needs Miles installed)"),
        overwrite: bool = typer.Option(False, "--overwrite", help="allow a non-empty --out (an interrupted run "
                                       "there starts over instead of resuming)"),
        checkpoint_every: float = typer.Option(10.0, "--checkpoint-every", min=0, help="checkpoint the run into "
                                               "OUT/resume at most every SECONDS (0: every step; kept under ~5% "
                                               "of the run's time); the same command run again resumes after "
                                               "the last checkpoint"),
        rollout_numerics: str = typer.Option("independent", "--rollout-numerics",
                                             help="independent (own quantizers + bf16 quantized-domain GEMMs) | "
                                                  "mirror (the trainer's quantizers and fp32 GEMM)"),
        routing_replay: bool = typer.Option(False, "--routing-replay", help="replay the rollout's MoE routing in "
                                            "the trainer's log-prob pass (Miles R3)"),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                     help="response length limit (default: the task's)"),
    ) -> None:
        """GRPO on the bundled tiny MoE: a plan-quantized trainer and a SEPARATE rollout engine that receives
        its quantized weights only through the live weight-update path. Writes metrics.jsonl, summary.json and
        run.png. With --engine miles: write (and optionally --launch) the equivalent Miles launch instead."""

        def body():
            from rich.markup import escape

            con = run_console()
            if engine == "miles":
                from .miles import emit_miles_launch

                out_dir = _fresh_out_dir(out, f"miles-{Path(policy or 'default').stem}", overwrite)
                script = emit_miles_launch(policy, model, parallel, out_dir, launch=launch)
                con.print(f"wrote {script}")
                return
            if engine == "verl":
                from .verl import emit_verl_launch

                out_dir = _fresh_out_dir(out, f"verl-{Path(policy or 'default').stem}", overwrite)
                con.print(f"wrote {emit_verl_launch(policy, model, parallel, out_dir, rollout=rollout)}")
                return
            if engine != "embedded":
                from ..console import UserError

                raise UserError(f"--engine must be embedded, miles or verl, got {engine!r}")
            from .loop import RunConfig
            from .plans import policy_path

            chosen = policy
            if chosen is None:  # the default that fits: the MoE recipes have nothing to quantize on a dense model
                from ..arch import load_architecture
                from .model import resolve_model_dir
                from .plans import DEFAULT_POLICY, default_policy

                model_dir = resolve_model_dir(model)
                chosen = default_policy(load_architecture(str(model_dir) if Path(model).is_dir() else model))
                if chosen != DEFAULT_POLICY:
                    con.print(f"{model} has no routed experts: default policy {chosen}")
            cfg = _run_config(RunConfig, policy=chosen, model=model, task=task, steps=steps, seed=seed,
                              device=device, prompts_per_step=prompts, samples_per_prompt=samples, lr=lr,
                              kl_coef=kl_coef, digits=digits, operators=operators, broken_contract=broken_contract,
                              rollout_device=rollout_device, trainer_etp=trainer_etp, rollout_etp=rollout_etp,
                              force_layout=force_layout, rollout_numerics=rollout_numerics,
                              routing_replay=routing_replay, max_new_tokens=max_new_tokens,
                              train_micro_batch=micro_batch, checkpoint_every_s=checkpoint_every)
            name = policy_path(chosen).stem
            out_dir, resume_state = _run_out_dir(out, f"{name}-s{seed}" + (f"-broken-{broken_contract}"
                                                                            if broken_contract else ""),
                                                 overwrite, cfg)
            cfg = cfg.model_copy(update={"out": out_dir})  # validated above; the directory exists only now
            con.print("[bold]policyc run[/] " + escape(f"{name} on {model} · task {task} · {steps} steps · seed "
                                                       f"{seed} · {device}" + (f" · rollout process on "
                                                       f"{rollout_device}" if rollout_device else "")
                                                       + (" · routing replay" if routing_replay else "")),
                      markup=True)
            con.print(use_available_threads())
            if resume_state is not None:
                done = resume_state["step"]
                con.print(escape(f"resuming {out_dir} after step {done} of {steps}" if done else
                                 f"starting {out_dir} again (interrupted before its first checkpoint)"))
            try:
                result = _live_run(cfg, name, resume_state)
            except KeyboardInterrupt as err:
                err.resume = _resume_hint(out_dir, overwrite)  # guard() prints it after "interrupted"
                raise
            s = write_run(result, out_dir)
            from .resume import finish

            finish(out_dir)  # complete: nothing is left to resume
            con.print(s["note"])
            con.print(f"plan {s['plan_hash'][:23]}…" + ("" if s["plan_hash"] == s["rollout_plan_hash"] else
                      f"  [bold red]rollout plan {s['rollout_plan_hash'][:23]}… (contract deliberately broken)[/]"),
                      markup=True)
            con.print(f"reward {s['reward_start']:.3f} -> {s['reward_end']:.3f} · train-rollout mean |Δlogp| "
                      f"{s['mismatch_abs_logp_mean']:.2e} (k3 {s['mismatch_k3_mean']:.2e}) · KL vs BF16 ref "
                      f"{s['kl_ref_k3_end']:.2e} · grad spikes {s['grad_spikes']} · rollout "
                      f"{s['rollout_tokens_per_s']:.0f} tok/s · quantized weights byte-identical every step: "
                      f"{s['quantized_weights_identical_every_step']} · {s['wall_s']:.0f}s")
            con.print(f"wrote {out_dir}/metrics.jsonl, summary.json, run.png")

        _guard(body)

    @app.command("ablate")
    def ablate_cmd(
        policies: List[str] = typer.Argument(..., help="policy files or shipped policy names"),
        seeds: int = typer.Option(1, "--seeds", min=1),
        steps: int = typer.Option(100, "--steps", min=1),
        out: Path = typer.Option(Path("runs/ablation"), "--out"),
        broken_contract: Optional[List[str]] = typer.Option(
            None, "--broken-contract", help="also run the first NVFP4 per-token policy with this broken contract "
                                            "(repeatable: per_tensor, unshared)"),
        device: str = typer.Option("cpu", "--device"),
        prompts: int = typer.Option(16, "--prompts"),
        lr: float = typer.Option(3e-4, "--lr"),
        overwrite: bool = typer.Option(False, "--overwrite", help="allow a non-empty --out; an interrupted "
                                       "ablation there starts over instead of resuming"),
        model: str = typer.Option("tiny-moe", "--model", help="bundled model name or HF Qwen3(-MoE) directory"),
        task: str = typer.Option("arithmetic", "--task"),
        digits: int = typer.Option(2, "--digits"),
        jobs: int = typer.Option(1, "--jobs", min=1, help="runs in parallel (processes; on one GPU they share it, "
                                 "so phase times are then not comparable)"),
        rollout_numerics: str = typer.Option("independent", "--rollout-numerics"),
        routing_replay: bool = typer.Option(False, "--routing-replay"),
        summarize_only: bool = typer.Option(False, "--summarize-only", help="only redraw the table/figure from "
                                            "the finished runs under --out"),
    ) -> None:
        """Run several policies x seeds and draw one figure like the MXFP8/NVFP4 RL blog: reward and mismatch per
        config, time per phase; print a table of final reward mean±std and mismatch."""

        def body():
            from .ablate import ablate, summarize_dir

            if summarize_only:
                summarize_dir(out, jobs=jobs)
                return
            from .ablate import PLAN_FILE

            # an ablation there is resumed (or refused as another one) by ablate() itself
            out_dir = _fresh_out_dir(out, "ablation", overwrite or (out / PLAN_FILE).is_file())
            ablate(policies, seeds=seeds, steps=steps, out=out_dir, broken_contract=broken_contract or (),
                   device=device, prompts=prompts, lr=lr, model=model, task=task, digits=digits, jobs=jobs,
                   rollout_numerics=rollout_numerics, routing_replay=routing_replay, fresh=overwrite,
                   again="re-run the same command" + (" without --overwrite" if overwrite else ""))

        _guard(body)


def _print_audit(res) -> None:
    """The audit as `policyc plan` groups tensors: collapsed expert ranges and layer runs, one row per cause."""
    from rich.markup import escape
    from rich.table import Table

    from ..console import console
    from ..names import collapse_names

    con = console()
    for path, what in res.read_as:
        con.print(f"read {escape(path)} as {escape(what)}")
    if res.trainer is None or res.rollout is None:
        con.print(f"only the {'trainer' if res.trainer is not None else 'rollout'} side was given: nothing to "
                  "compare (pass the other side's files too)")
        return
    if res.agree:
        con.print(f"[green]trainer and rollout agree[/] on every linear tensor of {escape(res.trainer.model)} "
                  f"(trainer plan {res.trainer.content_hash()})", markup=True)
        return
    table = Table(title=f"{sum(len(d.tensors) for d in res.disagreements)} tensor(s) where trainer and rollout "
                        "disagree", title_justify="left", header_style="bold", show_lines=True)
    for col in ("tensors", "count", "trainer", "rollout", "why"):
        table.add_column(col, overflow="fold")
    for d in res.disagreements:
        rows = collapse_names(d.tensors, brace_single=False)
        table.add_row(escape("\n".join(t for t, _ in rows)), "\n".join(str(n) for _, n in rows), escape(d.trainer),
                      escape(d.rollout), escape(d.cause))
    con.print(table)


def register_audit(app: typer.Typer) -> None:
    @app.command("audit")
    def audit_cmd(
        paths: List[Path] = typer.Argument(..., help="deployment files or directories: Miles launch script, "
                                           "Megatron args, TE YAML, env file, SGLang / vLLM args, rollout "
                                           "checkpoint, `policyc emit` directory"),
        model: str = typer.Option(..., "--model", "-m", help="bundled model name, config.json or checkpoint dir"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object (agree, disagreements, trainer, "
                                     "rollout)"),
        policy_out: Optional[Path] = typer.Option(None, "--policy-out", help="write the policy that reproduces "
                                                  "the agreed plan (or the trainer's)"),
        force: bool = typer.Option(False, "--force", help="replace an existing --policy-out file"),
    ) -> None:
        """Read an existing deployment back into per-tensor plans and show where trainer and rollout disagree.
        Exit 0 when they agree, 1 when they disagree, 2 on unreadable input."""

        def body():
            import json
            import sys

            from ..arch import load_architecture
            from ..backends.durable import OutputExists
            from .audit import audit, to_json

            if policy_out is not None and policy_out.exists() and not force:
                raise OutputExists(f"--policy-out '{policy_out}' already exists (pass --force to replace it)")
            res = audit(list(paths), load_architecture(model))
            if policy_out is not None:
                text = res.trainer_policy or res.rollout_policy
                tmp = policy_out.with_name(f".{policy_out.name}.tmp")
                tmp.write_text(text)
                tmp.replace(policy_out)
            if as_json:
                sys.stdout.write(json.dumps(to_json(res)) + "\n")
            else:
                _print_audit(res)
                if policy_out is not None:
                    from ..console import console

                    console().print(f"wrote {policy_out}")
            if not res.agree:
                raise typer.Exit(1)

        _guard(body)
