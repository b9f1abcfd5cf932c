"""The terminal front end's error contract, shared by every `policyc` command (plan/explain/check/diff, emit/convert/
verify, run/ablate): bad input prints `error: ...` + `hint: ...` (or a policy diagnostic with file:line:col and a
caret) and exits with the error's code, never a traceback.

Public: `UserError`, `console()`, `fail(err)`, `guard(body, expected=())`. Only rich and typer are imported at start-up.
"""

from __future__ import annotations

import os
import shutil
import sys

import typer


class UserError(Exception):
    """An error to print as `error: message` + `hint:` with exit code `code`."""

    def __init__(self, message: str, hint: str = "", code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.code = code


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Plan tables are wide: when piped (no terminal) or on a narrow terminal, lay out at 160 columns instead of
    # rich's default 80 so that names and formats stay on one line.
    width = None if stream.isatty() and shutil.get_terminal_size().columns >= 120 else int(
        os.environ.get("POLICYC_WIDTH", "180"))
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def fail(err: Exception) -> "typer.Exit":
    """Print `err` for the user (its `render()` if it has one, else message + hint) and return the Exit to raise."""
    con = console(stderr=True)
    render = getattr(err, "render", None)
    if callable(render):
        con.print(render(), markup=False)
    else:
        from rich.markup import escape

        message = getattr(err, "message", None) or (err.args[0] if err.args else str(err))
        con.print(f"[bold red]error:[/] {escape(str(message))}")
        hint = getattr(err, "hint", "")
        if hint:
            con.print(f"[cyan]hint:[/] {escape(hint)}")
    return typer.Exit(getattr(err, "code", 2) if isinstance(getattr(err, "code", None), int) else 2)


def guard(body, expected: tuple[type[BaseException], ...] = ()):
    """Run a command body, turning every expected error (the compiler's own, plus `expected`) into a diagnostic
    and an exit code. Anything else is a bug and propagates."""
    from .arch import ArchitectureError
    from .diagnostics import PolicyError
    from .parallel import ParallelSpecError

    try:
        return body()
    except typer.Exit:
        raise
    except (UserError, PolicyError, ArchitectureError, ParallelSpecError, *expected) as err:
        raise fail(err)
    except OSError as err:
        raise fail(UserError(f"{err.strerror or err}: {getattr(err, 'filename', '')}"))
