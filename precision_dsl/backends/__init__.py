"""policyc backends (sources in the repository's top-level backends/; see backends/__init__.py)."""

# One import name, two layouts. The backend modules live in the repository's top-level backends/ (the product's
# layout) and are imported everywhere as `precision_dsl.backends.<module>`; `import backends` is never used.
#
#   * wheel (`pip install .`): pyproject.toml excludes this file and force-includes backends/ AS
#     precision_dsl/backends/ (backends/__init__.py takes this file's place), so site-packages holds one package,
#     precision_dsl, and no generic top-level `backends`.
#   * source checkout -- the editable install, and `python -m pytest` / `python -m precision_dsl.cli` from the root
#     of any git worktree: this file points the package's search path at the checkout's own backends/, found
#     relative to this file (so each worktree runs its own backends, never another checkout's).
#
# The backend modules import the core with relative imports (`from ..plan import Plan`), which resolve through
# the package NAME `precision_dsl.backends`, so they work unchanged in both layouts.
from pathlib import Path as _Path

_SRC = _Path(__file__).resolve().parents[2] / "backends"
if not (_SRC / "__init__.py").is_file():  # a broken install must fail loudly, not lose emit/convert/verify
    raise ImportError(f"precision_dsl.backends: the backend sources '{_SRC}' are missing from this checkout")
__path__ = [str(_SRC)]  # backends/__init__.py holds only the package docstring: nothing to run from it
