"""The one cache the engine oracles read: downloaded wheels / sdists and the sites unpacked from them.

Everything lives under $POLICYC_ORACLE_CACHE (default ~/.cache/policyc-oracles): `download` keeps each file in
`wheels/` (pip download --no-deps from the package registry, once), `install_site` unpacks into `<name>/` and marks it
complete with `.complete` only after an atomic rename, so an interrupted first run never leaves a half site that a
later run would trust. Each oracle passes its own error class, so a failure reads as that oracle's unavailability.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional


def cache_dir() -> Path:
    return Path(os.environ.get("POLICYC_ORACLE_CACHE") or Path.home() / ".cache" / "policyc-oracles")


def download(req: str, error: type[Exception], *, source: bool = False, python_version: Optional[str] = None,
             dest: Optional[Path] = None, timeout: Optional[float] = None) -> Path:
    """The wheel (or, `source`, the sdist) of `req` ("name==version") in `dest` (default cache_dir()/wheels):
    downloaded the first time, reused after. `python_version`: the interpreter the wheel is for, when it is not this
    one. Raises `error` with pip's own reason."""
    name, version = req.split("==")
    dest = dest or cache_dir() / "wheels"
    pattern = f"{name}-{version}.tar.gz" if source else f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    # one download at a time per requirement (pytest-xdist workers share the cache), into a fresh directory whose
    # file is then renamed into place: a reader never sees a wheel that pip is still writing
    with _locked(dest / f".lock-{name}-{version}"):
        found = sorted(dest.glob(pattern))
        if found:
            return found[0]
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=dest))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                   "--no-binary=:all:" if source else "--only-binary=:all:", "-d", str(tmp), req]
            if python_version:
                cmd[4:4] = ["--python-version", python_version]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired) as err:
                raise error(f"cannot download {req} from the package registry: {err}") from err
            got = sorted(tmp.glob(pattern))
            if r.returncode != 0 or not got:
                raise error(f"cannot download {req} from the package registry ({' '.join(cmd)}): "
                            f"{(r.stderr or r.stdout).strip()[-600:]}")
            os.replace(got[0], dest / got[0].name)
            return dest / got[0].name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class _locked:
    """An exclusive advisory lock on `path` (created) for the duration of a with-block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def install_site(name: str, fill: Callable[[Path], None], marker: str) -> Path:
    """cache_dir()/name, made once: `fill(tmp)` unpacks into a fresh directory beside it, `marker` (what it was made
    from) is written to its `.complete`, then it replaces any stale `name` by one rename. A complete site is reused."""
    root = cache_dir()
    site = root / name
    if (site / ".complete").is_file():
        return site
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".lock-{name}"):  # one worker makes it; the others wait, then reuse it
        if (site / ".complete").is_file():
            return site
        tmp = Path(tempfile.mkdtemp(prefix=".site-", dir=root))
        try:
            fill(tmp)
            (tmp / ".complete").write_text(marker)
            if site.exists():
                shutil.rmtree(site)
            os.rename(tmp, site)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return site


def extract(whl: Path, dst: Path, keep: Callable[[str], bool] = lambda n: ".dist-info/" not in n) -> None:
    """The members of wheel `whl` that `keep` takes (default: all but its metadata), unpacked into `dst`."""
    with zipfile.ZipFile(whl) as z:
        z.extractall(dst, [n for n in z.namelist() if keep(n)])
