"""`policyc` command line. Commands are registered by small modules so that each part of the product owns its
commands; every heavy import (torch, transformers, megatron) happens inside a command, never at start-up."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="policyc",
    help="Declarative precision-policy compiler for low-precision RL (MXFP8 / NVFP4 / FP8-block).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)


def _register_all() -> None:
    from . import commands  # plan / explain / check / diff

    commands.register(app)
    from .backends import cli as backend_cli  # emit / convert / verify (a failing import fails loudly)
    from .engine import cli as engine_cli  # run / ablate

    backend_cli.register(app)
    engine_cli.register(app)


_register_all()


def main() -> None:
    # A policyc process is short-lived and builds tens of thousands of small containers (DeepSeek-V3: a 46k-tensor
    # plan, then per-tensor manifests). With the default thresholds (700, 10, 10) the cyclic GC runs a full
    # collection every ~70k allocations and rescans everything built so far: ~40% of `policyc emit`. Collect far
    # less often; the plan itself is moved out of the GC's view once built (commands.build_plan).
    import gc

    gc.set_threshold(200_000, 50, 100)
    app()


if __name__ == "__main__":
    main()
