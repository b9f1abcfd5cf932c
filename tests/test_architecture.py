"""The one allowed import direction of docs/ARCHITECTURE.md, checked on the source: every import statement of every
module (module level AND inside functions) is parsed with `ast`, resolved to a module of precision_dsl, and must
point from its layer to a layer that layer may use. Also: nothing anywhere imports a top-level `backends` (one
import name: `precision_dsl.backends`), and no module imports another package's private (`_name`) helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layers, lowest first: (name, module prefixes). A module belongs to the layer of its longest matching prefix.
LAYERS = [
    ("base", ["precision_dsl", "precision_dsl.precision", "precision_dsl.format_specs", "precision_dsl.resources",
              "precision_dsl.errors", "precision_dsl.jsonsafe"]),
    ("arch", ["precision_dsl.arch"]),
    ("diagnostics", ["precision_dsl.diagnostics"]),
    ("lang", ["precision_dsl.lang"]),
    ("plan", ["precision_dsl.plan", "precision_dsl.parallel"]),
    ("resolve", ["precision_dsl.resolve", "precision_dsl.checks"]),
    ("formats", ["precision_dsl.formats"]),
    ("kernels", ["precision_dsl.kernels"]),
    ("backends", ["precision_dsl.backends"]),
    ("engine", ["precision_dsl.engine"]),
    ("cli", ["precision_dsl.cli", "precision_dsl.console", "precision_dsl.commands", "precision_dsl.backends.cli",
             "precision_dsl.engine.cli"]),
]
# Which layers each layer may import (its own layer is always allowed). lang -> resolve -> plan <- formats/kernels
# <- backends <- engine <- cli: the plan IR is the hub; nothing below imports anything above it.
MAY_USE = {
    "base": set(),
    "arch": {"base"},
    "diagnostics": {"base"},
    "lang": {"base", "arch", "diagnostics"},
    "plan": {"base", "arch"},
    "resolve": {"base", "arch", "diagnostics", "lang", "plan"},
    "formats": {"base"},
    "kernels": {"base", "formats"},
    "backends": {"base", "arch", "plan", "formats", "kernels"},
    "engine": {"base", "arch", "diagnostics", "lang", "plan", "resolve", "formats", "kernels", "backends"},
    "cli": {name for name, _ in LAYERS},
}


def layer_of(module: str) -> str:
    best, name = -1, None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, name = len(p), layer
    assert name is not None, module
    return name


def core_modules() -> dict[str, Path]:
    """Every module of the installed package: precision_dsl/** and the repository's backends/** (installed as
    precision_dsl.backends.*)."""
    mods = {}
    for base, pkg in ((ROOT / "precision_dsl", "precision_dsl"), (ROOT / "backends", "precision_dsl.backends")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if pkg == "precision_dsl" and parts[:1] == ["backends"]:
                continue  # the import shim; the package's modules are the repository's backends/
            mods[".".join([pkg, *parts])] = path
    return mods


def imports_of(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def _resolve(target: str, names: list[str], mods: dict[str, Path]) -> list[str]:
    """The precision_dsl modules an import statement loads (`from pkg import mod` names a module too)."""
    if not (target == "precision_dsl" or target.startswith("precision_dsl.")):
        return []
    hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
    return hits or [target]


def test_layers_cover_every_module():
    mods = core_modules()
    assert len(mods) > 60 and "precision_dsl.backends.converter" in mods
    for m in mods:
        layer_of(m)


def violations(mods: dict[str, Path]) -> list[str]:
    bad = []
    for mod, path in mods.items():
        here = layer_of(mod)
        for line, target, names in imports_of(mod, path):
            where = f"{path.name if not path.is_relative_to(ROOT) else path.relative_to(ROOT)}:{line}"
            if target == "backends" or target.startswith("backends."):
                bad.append(f"{where}: imports top-level '{target}' (use precision_dsl.backends)")
                continue
            for dep in _resolve(target, names, mods):
                there = layer_of(dep)
                if there != here and there not in MAY_USE[here]:
                    bad.append(f"{where}: {mod} ({here}) imports {dep} ({there}) against the layer direction")
            # another package's private helpers: `from precision_dsl.formats import _x` / `formats._numerics`
            owner = ".".join(target.split(".")[:2])
            if target.startswith("precision_dsl.") and not mod.startswith(owner):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private or any(p.startswith("_") and not p.startswith("__") for p in target.split(".")):
                    bad.append(f"{where}: {mod} imports private {target} {private or ''} of another package")
    return bad


def test_imports_follow_the_layer_direction():
    bad = violations(core_modules())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "examples", "precision_dsl", "backends"])
def test_no_top_level_backends_import(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n == "backends" or n.startswith("backends.")]
    assert not bad, "import precision_dsl.backends, never the top-level name:\n" + "\n".join(bad)


def test_the_checker_catches_what_it_claims(tmp_path):
    """The rules fire: an engine module importing the cli layer (inside a function), a format importing a backend,
    a kernel importing a format's private helper, diagnostics importing the language, a top-level `backends`."""
    sources = {
        "precision_dsl.engine.x": "def f():\n    from .cli import register\n",
        "precision_dsl.formats.y": "from ..backends import common\n",
        "precision_dsl.kernels.z": "from ..formats import _check\n",
        "precision_dsl.diagnostics": "from .lang.ast import Span\n",
        "precision_dsl.backends.w": "import backends.common\n",
    }
    mods = {}
    for i, (mod, text) in enumerate(sources.items()):
        mods[mod] = tmp_path / f"m{i}.py"
        mods[mod].write_text(text)
    bad = violations(mods)
    assert len(bad) == len(sources), bad
    for needle in ("engine.x (engine) imports precision_dsl.engine.cli (cli)", "formats.y (formats) imports "
                   "precision_dsl.backends", "private precision_dsl.formats ['_check']", "diagnostics (diagnostics) "
                   "imports precision_dsl.lang.ast (lang)", "top-level 'backends.common'"):
        assert any(needle in b for b in bad), (needle, bad)


def test_tests_can_fail():
    """CLI tests let unexpected exceptions propagate (CliRunner with catch_exceptions=False: a crash fails the test
    instead of hiding in result.exception), and no test skips because an oracle of the test extra is missing."""
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            where = f"{path.name}:{node.lineno}"
            if name == "CliRunner" and path.name != "conftest.py":
                bad.append(f"{where}: use conftest.StrictCliRunner (catch_exceptions=False)")
            if path.name != "conftest.py" and any(k.arg == "catch_exceptions" and getattr(k.value, "value", None)
                                                  is not False for k in node.keywords):
                bad.append(f"{where}: catch_exceptions must stay False")
            if name == "importorskip" and node.args and getattr(node.args[0], "value", "").split(".")[0] in (
                    "torch", "transformers", "megatron", "triton", "safetensors"):
                bad.append(f"{where}: importorskip of {node.args[0].value}, which the test extra installs")
    assert not bad, "\n".join(bad)


def test_wheel_installs_one_package(tmp_path):
    """The built wheel holds one top-level package, precision_dsl, with the repository's backends/ inside it as
    precision_dsl/backends/ (the source-checkout shim is not shipped) and the bundled policies the hint names."""
    import subprocess
    import sys
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("policyc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"precision_dsl"}, tops
    for mod in sorted((ROOT / "backends").glob("*.py")):
        assert f"precision_dsl/backends/{mod.name}" in names
    init = zipfile.ZipFile(wheel).read("precision_dsl/backends/__init__.py").decode()
    assert init == (ROOT / "backends" / "__init__.py").read_text()
    assert "precision_dsl/_bundled/policies/mxfp8-e2e.policy" in names
