"""`policyc emit / convert / verify`. Registered by precision_dsl/cli.py at start-up, so this module imports only
typer; torch, safetensors, yaml and the backend modules are imported inside the command bodies.

Exit codes: 0 ok; 1 the plan is valid but a backend cannot express it (UnsupportedByBackend), a plan-hash mismatch,
or `verify` found differences; 2 bad input (policy/model/checkpoint/paths).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from precision_dsl.backends.registry import backend_names


def _run(body):
    """Run a command body under the one CLI guard (console.guard: every PolicycError -> error + hint + exit code)."""
    from precision_dsl.console import guard

    return guard(body)


def emit_artifacts(plan, backends: Optional[list[str]] = None, options=None):
    """All artifacts of `plan` for the chosen backends (default: all registered) + the plan itself; raises
    UnsupportedByBackend (BackendErrors: every problem of the first backend that refuses)."""
    from precision_dsl.backends.common import Problems, plan_artifact
    from precision_dsl.backends.registry import EmitOptions, backends as registered_backends

    arts = [plan_artifact(plan, "the plan (IR) with its content_hash")]
    options = options or EmitOptions()
    for backend in registered_backends(backends or None, options):
        problems = Problems()
        arts.extend(backend.emit(plan, options, problems))
        problems.raise_if_any()
    return arts


def chosen_backends(backend: Optional[List[str]]) -> Optional[list[str]]:
    from precision_dsl.console import UserError

    names = backend_names()
    bad = [b for b in backend or [] if b not in names]
    if bad:
        raise UserError(f"unknown backend '{bad[0]}'", f"choose from {', '.join(names)}")
    return list(backend) if backend else None


def _output_committed() -> None:
    """The output is complete and in place: a Ctrl-C from here on changes nothing (it would only turn a finished
    conversion into exit 130 with nothing to resume), so it is ignored for the rest of the process."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def backend_help() -> str:
    """--backend help: the registered names."""
    return (f"{' | '.join(backend_names())} (repeatable; default: every trainer / checkpoint / update backend and "
            "the --rollout engine)")


def rollout_help() -> str:
    """--rollout help (static: naming the engines would import every backend module at start-up)."""
    from precision_dsl.backends.registry import EmitOptions

    return f"the rollout engine the deployment serves with, a rollout backend (default {EmitOptions().rollout})"


def vllm_version_help() -> str:
    return ("the vLLM release the rollout serves with: emit what it serves, or refuse by name (default 0.33.0; "
            "judged: 0.24.0, 0.33.0)")


def emit_options(te_version: Optional[str], rollout: Optional[str] = None, vllm_version: Optional[str] = None):
    """EmitOptions of the command line (--te-version, --rollout and --vllm-version checked first)."""
    from precision_dsl.backends.registry import EmitOptions, rollout_names
    from precision_dsl.console import UserError

    checked_te_version(te_version)
    checked_version("--vllm-version", vllm_version, "0.33.0")
    if rollout is not None and rollout not in rollout_names():
        raise UserError(f"unknown rollout engine '{rollout}'", f"choose from {', '.join(rollout_names())}")
    return EmitOptions(te_version=te_version, vllm_version=vllm_version,
                       **({} if rollout is None else {"rollout": rollout}))


def checked_version(flag: str, v: Optional[str], example: str) -> None:
    from precision_dsl.console import UserError

    from precision_dsl.backends.versions import parse_version

    if v is not None:
        try:
            parse_version(v)
        except ValueError:
            raise UserError(f"cannot read {flag} '{v}'", f"write it like {example}") from None


def checked_te_version(v: Optional[str]) -> None:
    from precision_dsl.console import UserError

    from precision_dsl.backends.versions import parse_version

    if v is not None:
        try:
            parse_version(v)
        except ValueError:
            raise UserError(f"cannot read --te-version '{v}'", "write it like 2.17.0") from None


def print_diagnostics(diags, con) -> None:
    from rich.markup import escape

    for d in diags:
        colour = "red" if d.severity == "error" else "yellow"
        con.print(f"[bold {colour}]{d.severity}[/] {escape('[' + d.code + ']')} {escape(d.message)}", markup=True)
        if d.hint:
            con.print(f"  [cyan]hint:[/] {escape(d.hint)}", markup=True)


def register(app: typer.Typer) -> None:
    @app.command("emit")
    def emit_cmd(policy: Path = typer.Argument(..., help="policy file"),
                 model: str = typer.Option(..., "--model", "-m", help="bundled model name or config.json/dir"),
                 parallel: Optional[str] = typer.Option(
                     None, "--parallel", "-p", help="e.g. 'trainer:tp=2,etp=1,ep=8,pp=2 rollout:tp=8,ep=8'"),
                 out: Path = typer.Option(..., "--out", "-o", help="output directory (written atomically)"),
                 backend: Optional[List[str]] = typer.Option(None, "--backend", "-b", help=backend_help()),
                 te_version: Optional[str] = typer.Option(
                     None, "--te-version", help="installed TransformerEngine version: refuse a plan that needs a "
                                                "newer one (default: declare the minimum in the artifacts)"),
                 rollout: Optional[str] = typer.Option(None, "--rollout", help=rollout_help()),
                 vllm_version: Optional[str] = typer.Option(None, "--vllm-version", help=vllm_version_help()),
                 strict: bool = typer.Option(False, "--strict", help="treat check warnings as errors"),
                 force: bool = typer.Option(False, "--force", help="replace an existing --out directory")):
        """Emit the trainer / rollout / converter / weight-update artifacts of one plan (all carry its hash).
        Runs exactly the gate `policyc check` runs: nothing is written unless every check and backend passes."""

        def body():
            from precision_dsl.commands import build_plan_and_arch
            from precision_dsl.console import UserError, console
            from precision_dsl.engine.gate import run_gate

            from precision_dsl.backends.common import write_tree_atomic

            chosen = chosen_backends(backend)
            options = emit_options(te_version, rollout, vllm_version)
            plan, arch = build_plan_and_arch(policy, model, parallel)
            res = run_gate(plan, arch, chosen, options)
            con = console()
            if not res.ok(strict):
                print_diagnostics(res.diagnostics, console(stderr=True))
                errs = res.errors(strict)
                raise UserError(f"emit refused: {len(errs)} problem(s) (the same gate as `policyc check`); "
                                "nothing written", "fix the policy or the layout, or emit only the other "
                                                   "backends with --backend", 1)
            write_tree_atomic(out, res.artifacts, force=force)
            print_diagnostics(res.diagnostics, con)
            con.print(f"wrote {len(res.artifacts)} files to {out} (plan {plan.content_hash()[:19]}...)")
            for a in res.artifacts:
                con.print(f"  {a.path:<42} {a.description}", markup=False)

        _run(body)

    @app.command("convert")
    def convert_cmd(src: Path = typer.Argument(..., help="HF checkpoint directory (safetensors: BF16/FP16/FP32, or an FP8-block release such as DeepSeek-V3 / Kimi-K2)"),
                    policy: Path = typer.Option(..., "--policy", "-P", help="policy file"),
                    out: Path = typer.Option(..., "--out", "-o", help="output checkpoint directory"),
                    model: Optional[str] = typer.Option(None, "--model", "-m",
                                                        help="architecture (default: SRC/config.json)"),
                    parallel: Optional[str] = typer.Option(None, "--parallel", "-p", help="parallel layout"),
                    force: bool = typer.Option(False, "--force", help="replace an existing output directory"),
                    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
                    device: str = typer.Option("cpu", "--device",
                                               help="cpu | cuda (quantize with the fused Triton kernels)"),
                    rollout: Optional[str] = typer.Option(None, "--rollout",
                                                          help="the rollout engine that loads the checkpoint: its "
                                                               "tensor names and quantization_config (default "
                                                               "sglang)")):
        """Convert an HF checkpoint into the quantized checkpoint SGLang/vLLM load (resumable, atomic)."""

        def body():
            from precision_dsl.commands import build_plan
            from precision_dsl.console import UserError, console

            from precision_dsl.backends import converter

            if not Path(src).is_dir():
                raise UserError(f"source checkpoint '{src}' is not a directory")
            engine = emit_options(None, rollout).rollout  # an unknown engine is refused by name
            plan = build_plan(policy, model or str(src), parallel)
            if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
                raise UserError(f"unknown --device '{device}'", "use cpu or cuda")
            if device != "cpu":
                import torch

                if not torch.cuda.is_available():
                    raise UserError("--device cuda but no CUDA device is visible", "use --device cpu")
            rep = converter.convert(src, plan, out, force=force, progress=progress, device=device, rollout=engine,
                                    on_committed=_output_committed)
            console().print(f"wrote {out}: {len(rep.shards_written)} shard(s) written, "
                             f"{len(rep.shards_resumed)} resumed, {rep.bytes_in / 2**20:.1f} MiB -> "
                             f"{rep.bytes_out / 2**20:.1f} MiB, plan {plan.content_hash()[:19]}...")
            if rep.skipped_files:
                console().print(f"not copied (pickle files are never read): {', '.join(rep.skipped_files)}")

        _run(body)

    @app.command("verify")
    def verify_cmd(dst: Path = typer.Argument(..., help="converted checkpoint directory"),
                   source: Path = typer.Option(..., "--source", "-s", help="the HF checkpoint it was made from"),
                   policy: Optional[Path] = typer.Option(None, "--policy", "-P",
                                                         help="also require the plan of this policy"),
                   model: Optional[str] = typer.Option(None, "--model", "-m", help="architecture for --policy"),
                   parallel: Optional[str] = typer.Option(None, "--parallel", "-p")):
        """Re-derive every byte of DST from SOURCE and compare (exit 0 = identical, 1 = differences)."""

        def body():
            from precision_dsl.commands import build_plan
            from precision_dsl.console import console

            from precision_dsl.backends import converter

            expected = None
            if policy is not None:
                expected = build_plan(policy, model or str(source), parallel).content_hash()
            from rich.markup import escape

            problems = converter.verify(dst, source, expected_hash=expected)
            con = console()
            if problems:
                for p in problems[:50]:
                    con.print(f"[red]mismatch:[/] {escape(p)}", markup=True)
                if len(problems) > 50:
                    con.print(f"... and {len(problems) - 50} more")
                raise typer.Exit(1)
            con.print(f"verified: {dst} matches {source} under plan "
                      f"{converter.read_plan(dst).content_hash()[:19]}...")

        _run(body)
