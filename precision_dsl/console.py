"""The terminal front end's error contract, shared by every `policyc` command (plan/explain/check/diff, emit/convert/
verify, run/ablate): bad input prints `error: ...` + `hint: ...` (or a policy diagnostic with file:line:col and a
caret) and exits with the error's code, never a traceback.

Public: `UserError`, `console()`, `fail(err)`, `guard(body)`. Only rich and typer are imported at start-up.
"""

from __future__ import annotations

import os
import shutil
import sys

import typer
from .errors import PolicycError


class UserError(PolicycError):
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
    # markup=False: user-supplied text (policy names, tensor globs, echoed source, messages) is printed verbatim and
    # never parsed as rich markup ("[/x]" in a policy name used to raise MarkupError). Styled output passes Text
    # objects or print(..., markup=True) with every user part escaped.
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width, markup=False)


def fail(err: Exception) -> "typer.Exit":
    """Print `err` for the user (its `render()` if it has one, else message + hint) and return the Exit to raise."""
    con = console(stderr=True)
    render = getattr(err, "render", None)
    if callable(render):
        con.print(render(), markup=False)
    else:
        from rich.markup import escape

        message = getattr(err, "message", None) or (err.args[0] if err.args else str(err))
        con.print(f"[bold red]error:[/] {escape(str(message))}", markup=True)
        hint = getattr(err, "hint", "")
        if hint:
            con.print(f"[cyan]hint:[/] {escape(str(hint))}", markup=True)
    return typer.Exit(getattr(err, "code", 2) if isinstance(getattr(err, "code", None), int) else 2)


INTERRUPTED = 130  # the shell's exit status of a process stopped by SIGINT (128 + 2)


def guard(body):
    """Run a command body, turning every expected error into a diagnostic and an exit code: every `PolicycError`
    (the one hierarchy of user-facing errors, precision_dsl/errors.py), OSError, and Ctrl-C (exit 130, with how
    to resume where a re-run resumes). Anything else is a bug and
    propagates with its traceback (CLI tests run with catch_exceptions=False, so they fail on it)."""
    try:
        return body()
    except typer.Exit:
        raise
    except KeyboardInterrupt as err:
        # a resumable writer (the converter) re-raises the interrupt with how to pick its work up again
        resume = getattr(err, "resume", "")
        raise fail(UserError("interrupted" + (f"; {resume}" if resume else ""), code=INTERRUPTED))
    except PolicycError as err:
        raise fail(err)
    except OSError as err:
        where = f": {err.filename}" if getattr(err, "filename", None) else ""
        raise fail(UserError(f"{err.strerror or err}{where}"))
