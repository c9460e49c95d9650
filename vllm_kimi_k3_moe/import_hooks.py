"""Run callbacks on a module right after it has been imported, in any process.

vLLM imports model modules lazily, long after general plugins are loaded, and in
several processes (engine core, each TP worker, the model-registry subprocess).
A ``sys.meta_path`` finder lets the plugin patch a module at the moment it
exists without importing it (or anything heavy) when the plugin registers.

As wrapt's post-import hooks: each module has a list of callbacks; the loader
that runs them wraps the real loader once, and puts it back on the module
(``__spec__.loader``, ``__loader__``) after executing it, so the module looks
as if no hook had been there.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ModuleCallback = Callable[[ModuleType], None]


class _ExecThenCallbacks(importlib.abc.Loader):
    """Wraps the real loader; everything but ``exec_module`` is delegated."""

    def __init__(self, loader: importlib.abc.Loader, module_name: str):
        self._loader = loader
        self._module_name = module_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if getattr(module.__spec__, "loader", None) is self:
            module.__spec__.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        for callback in _finder.callbacks_for(self._module_name):
            callback(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, is_package...: tracebacks and inspect
        # keep working while the module executes.
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._callbacks: dict[str, list[ModuleCallback]] = {}
        self._lock = threading.RLock()

    def callbacks_for(self, module_name: str) -> list[ModuleCallback]:
        with self._lock:
            return list(self._callbacks.get(module_name, ()))

    def add(self, module_name: str, callback: ModuleCallback) -> bool:
        """Add ``callback`` for ``module_name``; False if it already was."""
        with self._lock:
            callbacks = self._callbacks.setdefault(module_name, [])
            if callback in callbacks:
                return False
            callbacks.append(callback)
            return True

    def remove(self, module_name: str, callback: ModuleCallback) -> None:
        with self._lock:
            callbacks = self._callbacks.get(module_name, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._callbacks.pop(module_name, None)

    def watched(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._callbacks)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                loader = spec.loader
                if loader is not None and not isinstance(loader, _ExecThenCallbacks):
                    spec.loader = _ExecThenCallbacks(loader, fullname)
                return spec
        return None


_finder = _AfterImportFinder()


def call_after_import(module_name: str, callback: ModuleCallback) -> None:
    """Call ``callback(module)`` each time ``module_name`` executes.

    Immediately if it is already imported, then on every later (re)import; the
    callback must therefore be idempotent. Adding the same callback twice
    changes nothing.
    """
    added = _finder.add(module_name, callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    module = sys.modules.get(module_name)
    if added and module is not None:
        callback(module)


def remove_after_import(module_name: str, callback: ModuleCallback) -> None:
    """Stop calling ``callback`` for ``module_name``; the finder leaves
    ``sys.meta_path`` once no module has callbacks."""
    _finder.remove(module_name, callback)
    if not _finder.watched() and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def watched_modules() -> frozenset[str]:
    """Modules that have callbacks (what the plugin will patch when imported)."""
    return _finder.watched()
