"""Crash-safe filesystem steps for writers of large outputs (the converter): every on-disk state transition is one
rename of a fully written and fsynced file, so a kill -9 or a full disk at any point leaves either the old state or
the new one, never a half-written file under its final name.

* `write_atomic(path, data, tmp_dir)`: temp file -> write -> fsync -> rename -> fsync the directory.
* `OutputLock(path)`: an exclusive `fcntl.flock` on `path` (released by the kernel when the process dies, so a
  crashed writer never leaves a stale lock); a second holder is refused by name with the owner's pid.
* `open_regular(path, inside)`: open a file for reading only if it is a regular file whose real path lies inside
  `inside` (no symlink escapes, no FIFOs/devices); checked on the opened descriptor, so there is no
  check-then-open race.
* `discard(path)`: rename a directory to a trash name, then delete it, so a crash mid-delete never leaves a
  half-deleted directory under a name a later run would trust.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Optional
from precision_dsl.errors import PolicycError


class OutputBusy(PolicycError):
    """Another process holds the lock of an output path."""

    code = 2

    def __init__(self, what: Path, pid: Optional[str]):
        self.hint = "wait for the other `policyc convert` to finish, or choose another --out"
        super().__init__(f"output '{what}' is being written by another policyc process"
                         + (f" (pid {pid})" if pid else ""))


class OutputExists(PolicycError, FileExistsError):
    """The output path exists and --force was not given (still a FileExistsError for existing callers)."""

    code = 2
    hint = "choose another --out or pass --force"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a resumable writer: still a KeyboardInterrupt (nothing that stops on one changes), carrying
    how to pick the work up again for the user."""

    resume = "re-run the same command to resume"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (os.write may write fewer bytes than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomic(path: Path, data: bytes, tmp_dir: Optional[Path] = None) -> None:
    """Replace `path` with `data` atomically and durably (the temp file lives in `tmp_dir`, same filesystem)."""
    path = Path(path)
    tmp = Path(tmp_dir or path.parent) / f".{path.name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_small(path: Path, limit: int) -> Optional[bytes]:
    """The bytes of a small regular file we wrote ourselves (markers, state), or None when it is absent, not a
    regular file, or larger than `limit` (all mean: not a valid marker)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


class OutputLock:
    """Exclusive advisory lock (flock) on a lock file next to an output; use as a context manager."""

    def __init__(self, lock_path: Path, what: Path):
        self.path, self.what, self.fd = Path(lock_path), Path(what), None
        # what a holder killed before removing the file left in it (its pid, then its last `mark`): "" otherwise
        self.previous = ""

    def __enter__(self) -> "OutputLock":
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                pid = os.pread(fd, 32, 0).decode(errors="replace").partition("\n")[0].strip() or None
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputBusy(self.what, pid) from None
                raise
            # The holder before us may have unlinked the file after we opened it: then we locked an orphan inode
            # and must retry on the current one (standard flock + unlink protocol).
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:  # the pid only improves the refusal message: a full disk must not fail (or leak) the lock
            self.previous = os.pread(fd, 4096, 0).decode(errors="replace")
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._end = len(str(os.getpid()))
        except OSError:
            self._end = None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def mark(self, text: str) -> None:
        """Record one line of progress after the pid (what `previous` shows the next holder if this process dies
        before removing the file). Best effort, like the pid; not a filesystem mutation (the file exists)."""
        if self.fd is None or self._end is None:
            return
        try:
            os.pwrite(self.fd, f"\n{text}".encode(), self._end)
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a waiter re-checks the inode (see __enter__)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


def open_regular(path: Path, inside: Path) -> Optional[int]:
    """A read descriptor for `path` if it is a regular file whose real location is inside the directory `inside`;
    None otherwise (symlink leaving `inside`, FIFO, device, directory, vanished)."""
    try:
        real = Path(os.path.realpath(path))
        root = Path(os.path.realpath(inside))
        if root not in real.parents:
            return None
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not os.path.samestat(st, os.stat(real, follow_symlinks=False)):
        os.close(fd)
        return None
    return fd


def copy_regular(fd: int, dst: Path, tmp_dir: Path) -> None:
    """Copy the open descriptor's content to `dst` atomically (temp in `tmp_dir`, fsync, rename)."""
    tmp = Path(tmp_dir) / f".{dst.name}.tmp"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            _write_all(out, chunk)
        os.fsync(out)
    finally:
        os.close(out)
    os.replace(tmp, dst)


def discard(path: Path) -> None:
    """Remove a directory tree so that a crash at any point leaves either the full tree or a trash name."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.parent / f"{path.name}.trash-{os.getpid()}"
    os.rename(path, trash)
    shutil.rmtree(trash)
