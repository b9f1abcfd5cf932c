"""`policyc` command line. Commands are registered by small modules so that each part of the product owns its
commands; every heavy import (torch, transformers, megatron) happens inside a command, never at start-up."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def _interrupted_at_start_up(signum, frame) -> None:
    # Ctrl-C while the commands are still being imported: nothing has been written yet, and a KeyboardInterrupt
    # raised inside a half-done import prints a traceback (or crashes the interpreter's teardown).
    os.write(2, b"interrupted\n")
    os._exit(130)


# Only the main thread may set handlers; restored once the commands are registered (a test importing this module
# keeps its own handler).
_previous_sigint = (signal.signal(signal.SIGINT, _interrupted_at_start_up)
                    if threading.current_thread() is threading.main_thread() else None)

import typer  # noqa: E402

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
    engine_cli.register_audit(app)  # audit


def _flags_show_no_type() -> None:
    """typer 0.29's rich help prints a type column even for a flag (`--json <bool>`, `--help <bool>`, as if each
    took a value). Leave that column blank for flags; parsing is unchanged."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_policyc_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich._policyc_flags = True
    TyperOption.display_type_rich = display_type_rich


try:
    _register_all()
    _flags_show_no_type()
finally:
    if _previous_sigint is not None:
        signal.signal(signal.SIGINT, _previous_sigint)


def main() -> None:
    # A policyc process is short-lived and builds tens of thousands of small containers (DeepSeek-V3: a 46k-tensor
    # plan, then per-tensor manifests). With the default thresholds (700, 10, 10) the cyclic GC runs a full
    # collection every ~70k allocations and rescans everything built so far: ~40% of `policyc emit`. Collect far
    # less often; the plan itself is moved out of the GC's view once built (commands.build_plan).
    import gc

    gc.set_threshold(200_000, 50, 100)
    interrupted: list[bool] = []
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _sigint_handler(interrupted))
    try:
        app()
    except SystemExit as done:
        if done.code != 130 and not interrupted:
            _ignore_sigint()  # the command is over: a Ctrl-C in the interpreter's teardown changes nothing
            raise
        _leave_interrupted(said=done.code == 130)
    except BaseException:
        # After a Ctrl-C anything can surface (a half-done import raises ImportError / SystemError on its next use,
        # click turns the KeyboardInterrupt into Abort): the interrupt is the cause, so say that and stop.
        if not interrupted:
            raise
        _leave_interrupted(said=False)
    else:
        _ignore_sigint()


def _importing(frame) -> bool:
    """Whether the thread that `frame` belongs to is inside an import: a module body still executing under
    importlib's `_find_and_load` (a module already in sys.modules never reaches it)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load" and code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _sigint_handler(interrupted: list):
    """The command's SIGINT handler: a KeyboardInterrupt at the next Python statement, except inside an import.

    A KeyboardInterrupt raised inside an import can land in Python code that a C extension's initialiser calls:
    torch 2.13's `torch/distributed/__init__.py` calls `torch._C._c10d_init()`, whose pybind11 code turns the
    exception into a C++ throw it does not catch, and the process aborts ("Fatal Python error: Aborted"). So a
    Ctrl-C during an import is held and delivered again once the main thread has left every import (at most the
    import's duration: ~1-2 s for torch)."""
    redelivery = threading.Lock()
    main_ident = threading.main_thread().ident

    def deliver_after_imports() -> None:
        try:
            while True:
                time.sleep(0.01)
                frame = sys._current_frames().get(main_ident)
                if frame is None:  # the main thread is gone: nothing left to interrupt
                    return
                if not _importing(frame):
                    break
        finally:
            redelivery.release()
        signal.raise_signal(signal.SIGINT)  # runs this handler again in the main thread, outside the import

    def on_sigint(signum, frame):
        if _importing(frame):
            if redelivery.acquire(blocking=False):  # one pending Ctrl-C is enough
                threading.Thread(target=deliver_after_imports, name="policyc-sigint", daemon=True).start()
            return
        interrupted.append(True)
        raise KeyboardInterrupt

    return on_sigint


def _ignore_sigint() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _leave_interrupted(said: bool) -> None:
    """Exit 130 without the interpreter's teardown. A Ctrl-C that landed inside `import torch` leaves torch's C
    extension half-registered, and tearing that down segfaults; every `finally` of the command has already run."""
    if not said:
        os.write(2, b"interrupted; re-run the same command to resume\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


if __name__ == "__main__":
    main()
