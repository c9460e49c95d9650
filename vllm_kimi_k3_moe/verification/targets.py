"""The upstream objects a patch declares (``TARGETS``), found as upstream
defined them, and what is compared of them: a digest of their source and
their signatures.

A target is ``"module:qualified.name"``. Two questions are kept apart:

- what vLLM's installed code is (``source``, ``find``): read from the
  module's source as installed, and the function compiled from it, found
  through any patch on it (the plugin's subclass layers and wrappers, and
  another's wrapper that calls on it), so that the answer is the same
  before and after anyone patched (``doctor`` asks in a process that may
  have);
- whether other code replaced it at run time (``replacement``): the object
  vLLM calls now, through the plugin's own patches, is not the function
  the module defines; named by its module and function.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import textwrap
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.patching import callables_reached, own_function, upstream_class


class TargetMissing(LookupError):
    """A target is not in this vLLM (its module or an attribute on the way)."""


class ReplacedOutOfReach(LookupError):
    """A target was replaced at run time by code that does not lead back to
    the installed one (needed where the installed code is not verified)."""


def _module(target: str) -> tuple[ModuleType, str]:
    module_name, _, qualname = target.partition(":")
    try:
        return importlib.import_module(module_name), qualname
    except ImportError as error:
        raise TargetMissing(f"no module {module_name}") from error


def live(target: str) -> Any:
    """What vLLM calls for ``target`` now: the module's attribute (a class's
    own, through the plugin's subclass layers and wrappers, which are not
    another's code); ``TargetMissing`` if it is not there."""
    obj: Any
    obj, qualname = _module(target)
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
    return own_function(obj)


def _definition(target: str) -> tuple[ast.AST, list[str], str]:
    """Where the installed module defines ``target``: its syntax node, the
    file's lines and its path (the module's source as installed, whatever
    object its attribute holds now)."""
    module, qualname = _module(target)
    path = inspect.getsourcefile(module) or ""
    lines, tree = _parsed(module.__name__, path, _modified(path))
    body = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        named = [
            n
            for n in body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name == part
        ]
        if not named:
            raise TargetMissing(f"no {target} in {module.__name__}'s source")
        node = named[-1]  # the last definition is the one the module keeps
        body = node.body
    assert node is not None
    return node, lines, path


def _modified(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


@functools.lru_cache(maxsize=32)
def _parsed(module_name: str, path: str, modified: int) -> tuple[list[str], ast.Module]:
    """A module's source lines and syntax tree, parsed once per file version
    (judging asks each module for several targets)."""
    lines = inspect.getsourcelines(importlib.import_module(module_name))[0]
    return lines, ast.parse("".join(lines))


def _first_line(node: Any) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _called_as_defined(target: str) -> Any:
    """What vLLM calls for ``target`` where that is, by its code, the
    function the module's file defines under that name (the common case,
    told without parsing the file: Python 3.11 codes know their qualified
    name), else None."""
    obj = live(target)
    module, qualname = _module(target)
    code = getattr(obj, "__code__", None)
    path = getattr(module, "__file__", None)
    if (
        code is None
        or path is None
        or getattr(code, "co_qualname", None) != qualname
        or os.path.realpath(code.co_filename) != os.path.realpath(path)
    ):
        return None
    return obj


def source(target: str) -> str:
    """The source of ``target`` as the installed module defines it (its
    lines as the file has them, decorators included), read from the module,
    not from the object its attribute holds now."""
    defined = _called_as_defined(target)
    if defined is not None:
        return inspect.getsource(defined)
    node, lines, _ = _definition(target)
    return "".join(lines[_first_line(node) - 1 : node.end_lineno])  # type: ignore[attr-defined]


def _is_definition(obj: Any, node: Any, path: str) -> bool:
    """Whether ``obj`` is the function compiled from ``node`` of ``path`` (a
    decorator the file applies may wrap it)."""
    if node.decorator_list and callable(obj):
        obj = inspect.unwrap(obj)
    code = getattr(obj, "__code__", None)
    return (
        code is not None
        and code.co_name == node.name
        and code.co_firstlineno == _first_line(node)
        and os.path.realpath(code.co_filename) == os.path.realpath(path)
    )


def replacement(target: str) -> str | None:
    """Who replaced ``target`` at run time (``module.function`` of the object
    vLLM calls instead of its own), or None where it calls its own."""
    if _called_as_defined(target) is not None:
        return None
    obj = live(target)
    node, _, path = _definition(target)
    if _is_definition(obj, node, path):
        return None
    return name_of(obj)


def name_of(obj: Any) -> str:
    """``module.qualified_name`` of a callable's code, as its file defines it
    (``functools.wraps`` gives a wrapper the name of what it wraps)."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        module = getattr(obj, "__globals__", {}).get("__name__", "?")
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
    if isinstance(obj, functools.partial):
        return f"functools.partial({name_of(obj.func)})"
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def find(target: str) -> Any:
    """The upstream object ``target`` names, as the installed module defines
    it: what vLLM calls, or, where other code replaced it at run time, the
    installed function that code calls on (``ReplacedOutOfReach`` where it
    does not lead back to it); ``TargetMissing`` if it is not there."""
    obj = live(target)
    if not callable(obj) or isinstance(obj, type):
        return obj
    node, _, path = _definition(target)
    for reached in callables_reached(obj):
        if _is_definition(reached, node, path):
            return reached
    raise ReplacedOutOfReach(
        f"{target} is replaced at run time by {name_of(obj)}, which does not "
        "lead back to vLLM's own"
    )


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
