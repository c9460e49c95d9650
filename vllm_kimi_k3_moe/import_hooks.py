"""Run a callback on a module right after it has been imported, in any process.

vLLM imports model modules lazily, long after general plugins are loaded, and in
several processes (engine core, each TP worker, the model-registry subprocess).
A ``sys.meta_path`` finder lets the plugin patch a module at the moment it
exists without importing it (or anything heavy) when the plugin registers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ModuleCallback = Callable[[ModuleType], None]


class _ExecThenCallback(importlib.abc.Loader):
    """Wraps the real loader; everything but ``exec_module`` is delegated."""

    def __init__(self, loader: importlib.abc.Loader, callback: ModuleCallback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, is_package...: tracebacks and inspect
        # keep working on the wrapped module.
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, ModuleCallback] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ExecThenCallback(spec.loader, callback)
                return spec
        return None


_finder = _AfterImportFinder()


def call_after_import(module_name: str, callback: ModuleCallback) -> None:
    """Call ``callback(module)`` each time ``module_name`` executes.

    Immediately if it is already imported, then on every later (re)import; the
    callback must therefore be idempotent.
    """
    _finder.callbacks[module_name] = callback
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)


def watched_modules() -> frozenset[str]:
    """Modules that have a callback (for tests and diagnostics)."""
    return frozenset(_finder.callbacks)
