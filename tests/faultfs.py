"""Filesystem fault injection for crash-safety tests: count every filesystem mutation a piece of code makes
(os.replace/rename/unlink/remove/rmdir/mkdir/fsync/ftruncate, os.open and open() for writing) and simulate a
kill -9 before or after the k-th one.

A simulated crash raises `Crash` (a BaseException, so no `except Exception` swallows it) and FREEZES the
filesystem: every later mutation raises `Crash` too, so `finally:` clean-up code cannot tidy up what a killed
process would have left behind. Reads stay allowed (they change nothing on disk). A real-process variant lives in
tests/test_convert_faults.py (os._exit in a subprocess) to check the simulation against the real thing.
"""

from __future__ import annotations

import builtins
import io
import os
from contextlib import contextmanager
from typing import Optional


class Crash(BaseException):
    pass


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class FaultFS:
    def __init__(self, crash_at: Optional[int] = None, after: bool = False, on_crash=None, real_fsync: bool = False):
        # fsync is recorded as a mutation point but, by default, not performed: a simulated kill loses nothing the
        # kernel already holds (only power loss would), and skipping it makes the exhaustive suites ~2x faster.
        self.crash_at, self.after, self.on_crash, self.real_fsync = crash_at, after, on_crash, real_fsync
        self.ops: list[tuple[str, str]] = []
        self.frozen = False

    def _tick(self, op: str, path) -> bool:
        """Record one mutation; raise before it when it is the crash point. Returns True when the crash must
        happen right AFTER the operation."""
        if self.frozen:
            raise Crash(f"frozen: {op} {path}")
        k = len(self.ops)
        self.ops.append((op, os.path.basename(str(path))))
        if k == self.crash_at and not self.after:
            self._crash()
        return k == self.crash_at and self.after

    def _crash(self):
        self.frozen = True
        if self.on_crash is not None:
            self.on_crash()
        raise Crash(f"simulated kill at mutation {self.crash_at} ({'after' if self.after else 'before'} "
                    f"{self.ops[-1]})")

    def _wrap(self, op: str, fn, path_arg: int = 0, is_write=None):
        def wrapped(*a, **kw):
            path = a[path_arg] if len(a) > path_arg else kw.get("file", kw.get("path", "?"))
            if is_write is not None and not is_write(*a, **kw):
                return fn(*a, **kw)
            crash_after = self._tick(op, path)
            out = fn(*a, **kw)
            if crash_after:
                self._crash()
            return out

        return wrapped

    @contextmanager
    def installed(self):
        def os_open_writes(path, flags, *a, **kw):
            return bool(flags & _WRITE_FLAGS)

        def open_writes(file, mode="r", *a, **kw):
            return isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+")

        saved = {}
        patches = {
            (os, "replace"): self._wrap("replace", os.replace),
            (os, "rename"): self._wrap("rename", os.rename),
            (os, "unlink"): self._wrap("unlink", os.unlink),
            (os, "remove"): self._wrap("remove", os.remove),
            (os, "rmdir"): self._wrap("rmdir", os.rmdir),
            (os, "mkdir"): self._wrap("mkdir", os.mkdir),
            (os, "fsync"): self._wrap("fsync", os.fsync if self.real_fsync else (lambda fd: None)),
            (os, "ftruncate"): self._wrap("ftruncate", os.ftruncate),
            (os, "open"): self._wrap("open-write", os.open, is_write=os_open_writes),
            (builtins, "open"): self._wrap("open-write", builtins.open, is_write=open_writes),
            (io, "open"): self._wrap("open-write", io.open, is_write=open_writes),
        }
        for (mod, name), fn in patches.items():
            saved[(mod, name)] = getattr(mod, name)
            setattr(mod, name, fn)
        try:
            yield self
        finally:
            for (mod, name), fn in saved.items():
                setattr(mod, name, fn)
