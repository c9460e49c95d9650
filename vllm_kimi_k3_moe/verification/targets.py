"""The upstream objects a patch declares (``TARGETS``), found as upstream
defined them, and what is compared of them: a digest of their source and
their signatures.

A target is ``"module:qualified.name"``. Found through any patch already on
them: a class the plugin layered (``patching.upstream_class``), a function
it wrapped (``__wrapped__``), so that the answer is the same before and
after the plugin patched (``doctor`` asks in a process that may have).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Iterable
from typing import Any

from vllm_kimi_k3_moe.patching import upstream_class


class TargetMissing(LookupError):
    """A target is not in this vLLM (its module or an attribute on the way)."""


def find(target: str) -> Any:
    """The upstream object ``target`` names; ``TargetMissing`` if it is not
    there."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise TargetMissing(f"no module {module_name}") from error
    for part in qualname.split("."):
        if isinstance(obj, type):
            obj = upstream_class(obj)
            found = inspect.getattr_static(obj, part, None)
        else:
            found = getattr(obj, part, None)
        if found is None:
            raise TargetMissing(f"no {target}")
        obj = found
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return inspect.unwrap(obj) if callable(obj) else obj


def source(target: str) -> str:
    """The source of the upstream object ``target`` names (its lines as the
    file has them, wherever in the file they are)."""
    return inspect.getsource(find(target))


def signature(target: str) -> str:
    """The signature of the callable ``target`` names, as Python prints it."""
    return str(inspect.signature(find(target)))


def digest(targets: Iterable[str]) -> str:
    """One digest of the targets' names and source: equal where every target
    is the same code."""
    sha = hashlib.sha256()
    for target in targets:
        sha.update(target.encode())
        sha.update(b"\0")
        sha.update(source(target).encode())
        sha.update(b"\0")
    return sha.hexdigest()[:16]


def keyword_arguments(target: str, function: str, keyword: str) -> list[str]:
    """The expressions the code of ``target`` passes as ``keyword=`` to calls
    of ``function`` (a name or attribute), in source order, as written."""
    tree = ast.parse(textwrap.dedent(source(target)))
    found = []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        called = node.func
        name = called.attr if isinstance(called, ast.Attribute) else None
        if isinstance(called, ast.Name):
            name = called.id
        if name != function:
            continue
        found += [ast.unparse(k.value) for k in node.keywords if k.arg == keyword]
    return found


def names_used(target: str) -> frozenset[str]:
    """The global and attribute names the code of ``target`` uses."""
    return frozenset(find(target).__code__.co_names)
