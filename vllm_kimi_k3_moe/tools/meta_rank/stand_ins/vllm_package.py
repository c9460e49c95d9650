"""Stands in for the ``vllm`` package module while ``doctor`` imports
vLLM's plugin loader.

Why: ``vllm/__init__.py`` imports torch's compiler (``vllm.env_override``)
for settings the plugin loader never reads: seconds of a question that
takes one. What the real initialiser guarantees is not needed by
``vllm.plugins``, ``vllm.version`` and ``vllm.platforms`` (which import only
``vllm.envs``); every ``vllm`` module imported under the stand-in is
forgotten on exit, so a later ``import vllm`` runs the real initialiser.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def vllm_without_its_package_initialiser() -> Iterator[None]:
    """Import ``vllm``'s submodules (``vllm.plugins``, ``vllm.version``,
    ``vllm.platforms``) without running ``vllm/__init__.py`` first: the
    package module is made from its spec but not executed. Why: that file
    imports ``vllm.env_override``, which imports torch and its compiler
    (inductor, dynamo: 5-10 s idle, more on a loaded host) to set compiler
    options, none of which vLLM's plugin loader reads (``vllm.plugins``
    imports only ``vllm.envs``, which is the standard library). ``doctor``
    asks the loader through it. On exit every ``vllm`` module imported
    inside is forgotten, so a later ``import vllm`` runs the real
    initialiser; where vLLM is imported already, nothing is replaced.
    Re-check: ``vllm/plugins/__init__.py``'s imports."""
    if "vllm" in sys.modules:
        yield
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
    sys.modules["vllm"] = importlib.util.module_from_spec(spec)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
