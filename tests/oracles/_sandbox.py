"""Import an engine's Python sources on a CPU-only box whose third-party dependencies are mostly absent.

The engine's modules are imported for real (their code runs unchanged); only a module that is NOT installed and that
an engine module imports directly (CUDA kernels, servers, tokenizers: triton, sgl_kernel, zmq, ...) is replaced by an
inert stub. The stubs are visible only while the sandbox is entered: on exit every module it added (the engine's and
the stubs) is taken out of `sys.modules` and kept aside, so the rest of the test session never sees a fake `triton`.
Root logging and `os.environ` changes made by the engine are undone on exit as well.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import types
from contextlib import contextmanager
from typing import Optional


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new_stub(name)

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _StubBase(metaclass=_StubMeta):
    """Whatever an absent dependency's attribute is used as: a base class, a decorator, a call, a constant."""

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # used as a field type in an engine's pydantic model
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            return args[0]
        return _new_stub("result")()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new_stub(name)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __getitem__(self, key):
        return self


def _new_stub(name: str) -> type:
    return _StubMeta(str(name), (_StubBase,), {})


class _StubModule(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _new_stub(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: answers only for modules no real finder has, imported from an engine module."""

    def __init__(self, packages: tuple[str, ...], only: Optional[frozenset[str]] = None):
        self.packages = packages
        self.only = only  # None: any absent module an engine imports; else just these top-level names
        self.stubbed: set[str] = set()  # top-level names

    def _from_engine(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if not (frame.f_code.co_filename.startswith("<frozen") or name.startswith("importlib")):
                return name.split(".")[0] in self.packages
            frame = frame.f_back
        return False

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in self.packages:
            return None
        if top not in self.stubbed:
            if self.only is not None and top not in self.only:
                return None
            if not self._from_engine():
                return None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                try:
                    if finder.find_spec(fullname, path, target) is not None:
                        return None
                except Exception:  # a broken finder must not make a stub win
                    continue
            self.stubbed.add(top)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


class Sandbox:
    """`with sandbox:` makes the engine importable (site dir on sys.path, its modules and stubs in sys.modules)."""

    def __init__(self, site: str, packages: tuple[str, ...], stubs: Optional[tuple[str, ...]] = None):
        """`stubs`: the only absent top-level modules that may be stubbed (an engine that probes optional packages
        with `try: import x` / `find_spec` must see every other absent package as absent); None: any."""
        self.site = site
        self.packages = packages
        self.finder = _StubFinder(packages, None if stubs is None else frozenset(stubs))
        self._kept: dict[str, types.ModuleType] = {}
        self._own_tops = set(packages)

    def _ours(self, name: str) -> bool:
        top = name.split(".")[0]
        return top in self._own_tops or top in self.finder.stubbed

    def __enter__(self):
        # torch decides once whether triton exists; let it decide before any stub can be seen.
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
        import torch._functorch.aot_autograd  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        import torch.utils.flop_counter  # noqa: F401

        self._env = dict(os.environ)
        root = logging.getLogger()
        self._logging = (list(root.handlers), root.level)
        sys.path.insert(0, self.site)
        sys.meta_path.append(self.finder)
        sys.modules.update(self._kept)
        self._before = set(sys.modules)
        return self

    def __exit__(self, *exc):
        for name in list(sys.modules):
            if name not in self._before and self._ours(name) or name in self._kept:
                self._kept[name] = sys.modules.pop(name)
        # modules a real library imported lazily under a stub's influence are not ours: leave them
        sys.meta_path.remove(self.finder)
        sys.path.remove(self.site)
        os.environ.clear()
        os.environ.update(self._env)
        root = logging.getLogger()
        root.handlers[:] = self._logging[0]
        root.setLevel(self._logging[1])
        return False


@contextmanager
def env(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
