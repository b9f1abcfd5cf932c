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
    app()


if __name__ == "__main__":
    main()
