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
    try:
        from backends import cli as backend_cli  # emit / convert / verify
    except ImportError:  # pragma: no cover - only while the backends package is being built
        backend_cli = None
    if backend_cli is not None:
        backend_cli.register(app)
    try:
        from .engine import cli as engine_cli  # run / ablate
    except ImportError:  # pragma: no cover
        engine_cli = None
    if engine_cli is not None:
        engine_cli.register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
