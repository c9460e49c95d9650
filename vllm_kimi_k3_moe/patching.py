"""Changes to upstream classes and modules that can be undone exactly.

Three shapes of change, each with its inverse, used by the serving patches
and by the tools' temporary stand-ins alike:

- ``wrap_method`` / ``unwrap_method``: a wrapper around one method of a
  class (or function of a module), in a gate the plugin knows by identity,
  so that applying twice wraps once and reverting puts back exactly the
  object the class held (a ``staticmethod`` or ``classmethod`` stays one;
  an inherited method is inherited again). Other code may wrap the same
  method before or after: the plugin's wrapper calls what was there, and
  reverting under another's wrapper closes the gate (it then only hands
  on) instead of dropping that wrapper.
- ``add_subclass_layer`` / ``remove_subclass_layer``: a module's class
  replaced by a subclass of itself with one more base in front. Several
  patches may each add their own layer to the same class and each remove
  only its own; ``upstream_class`` finds the class upstream defined.
- ``replaced_attributes``: attributes set for the duration of a ``with``
  block, then put back as the target held them.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# Every gate ``wrap_method`` put on a class or module, by (owner, name), and
# what each gate holds, by the gate: the plugin's own wrappers are told by
# identity (a wrapper someone put over one with ``functools.wraps`` copies
# its attributes, not its identity).
_INSTALLED: dict[tuple[Any, str], Callable[..., Any]] = {}
_GATES: weakref.WeakKeyDictionary[Any, _Gate] = weakref.WeakKeyDictionary()
# Set on a class made by ``add_subclass_layer``: the base it put in front.
LAYER = "kimi_k3_layer"


@dataclass
class _Gate:
    """One of the plugin's wrappers: the attribute it replaced, whether the
    owner defined it (else inherited), the function inside it, and whether
    its wrapper acts (else the gate calls ``own`` unchanged)."""

    attribute: Any
    defined_here: bool
    own: Callable[..., Any]
    on: bool = True


def _function_of(attribute: Any) -> Any:
    """The function inside a ``staticmethod``/``classmethod``, else itself."""
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    return attribute


def own_function(function: Any) -> Any:
    """What one of the plugin's wrappers wraps (``function`` itself if it is
    none): the object that was there before the plugin patched."""
    gate = _GATES.get(function) if callable(function) else None
    return function if gate is None else own_function(gate.own)


def is_plugin_wrapper(function: Any) -> bool:
    """Whether ``function`` is one of the plugin's own wrappers."""
    return callable(function) and function in _GATES


def wrap_method(owner: Any, name: str, make_wrapper: Callable[[Any], Any]) -> None:
    """Put ``make_wrapper(own)`` in front of ``owner.name`` (a class's method
    or a module's function) unless it is there (idempotent).

    ``own`` is what ``owner.name`` holds now (unbound: a ``staticmethod``'s
    or ``classmethod``'s function), the upstream function or whatever other
    code put there: the wrapper calls it, so a wrapper someone installed
    before the plugin still runs. The wrapper goes in a gate, put back in
    the same kind of descriptor, which ``unwrap_method`` closes."""
    installed = _INSTALLED.get((owner, name))
    if installed is not None and _reachable(owner, name, installed):
        _GATES[installed].on = True  # outermost, or inside another's wrapper
        return
    _INSTALLED.pop((owner, name), None)  # replaced since by code not calling it
    attribute = inspect.getattr_static(owner, name)
    own = _function_of(attribute)
    if own in _GATES:  # a closed one of ours, put back by code that saved it
        _GATES[own].on = True
        _INSTALLED[owner, name] = own
        return
    wrapper = make_wrapper(own)

    @functools.wraps(own)
    def gate(*args: Any, **kwargs: Any) -> Any:
        if _GATES[gate].on:
            return wrapper(*args, **kwargs)
        return own(*args, **kwargs)

    _GATES[gate] = _Gate(attribute, name in vars(owner), own)
    _INSTALLED[owner, name] = gate
    held = type(attribute)(gate) if attribute is not own else gate
    setattr(owner, name, held)


def unwrap_method(owner: Any, name: str) -> None:
    """Undo ``wrap_method`` on ``owner.name`` (nothing if it is not wrapped):
    where the plugin's wrapper is still what the owner holds, the attribute
    it replaced is put back exactly; where other code wrapped it since, that
    code's wrapper stays and keeps calling the plugin's, which now only
    hands on to what it wraps (``wrap_method`` opens it again)."""
    gate = _INSTALLED.get((owner, name))
    if gate is None:
        return
    state = _GATES[gate]
    state.on = False
    live = _function_of(inspect.getattr_static(owner, name, None))
    if live is not gate:
        if not _reachable(owner, name, gate):  # gone from what the owner calls
            del _INSTALLED[owner, name]
        return
    del _INSTALLED[owner, name]
    if state.defined_here:
        setattr(owner, name, state.attribute)
    else:
        delattr(owner, name)


def callables_reached(function: Any, depth: int = 4) -> Iterator[Any]:
    """``function`` and the callables it may call on, ``depth`` steps deep:
    what it wraps (``__wrapped__``, a ``functools.partial``'s function, a
    bound method's), the values of its closure and the globals its code
    names. How a wrapper holds what it wraps, in the shapes other code
    writes them (``orig = X.f`` at module level, or a closure)."""
    seen: set[int] = set()
    level = [function]
    for _ in range(depth):
        following = []
        for item in level:
            if id(item) in seen:
                continue
            seen.add(id(item))
            yield item
            found = [
                getattr(item, a, None) for a in ("__wrapped__", "func", "__func__")
            ]
            code = getattr(item, "__code__", None)
            if code is not None:
                found += [_cell(c) for c in getattr(item, "__closure__", None) or ()]
                names = getattr(item, "__globals__", {})
                found += [names.get(n) for n in code.co_names]
            following += [_function_of(f) for f in found if callable(f)]
        level = following


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _reachable(owner: Any, name: str, gate: Any) -> bool:
    """Whether what ``owner.name`` holds now calls on ``gate``."""
    live = _function_of(inspect.getattr_static(owner, name, None))
    return any(f is gate for f in callables_reached(live))


def lost_wrappers() -> list[tuple[Any, str, Any]]:
    """Each open wrapper of the plugin that what its owner holds now no
    longer calls (other code replaced it since, without calling on it):
    (owner, name, what it holds)."""
    return [
        (owner, name, _function_of(inspect.getattr_static(owner, name, None)))
        for (owner, name), gate in list(_INSTALLED.items())
        if _GATES[gate].on and not _reachable(owner, name, gate)
    ]


def upstream_class(cls: type) -> type:
    """The class ``add_subclass_layer`` calls were stacked on."""
    return _unstack(cls)[0]


def _unstack(cls: type) -> tuple[type, list[type]]:
    """The class the layers were stacked on, and the bases put in front of
    it, innermost first."""
    layers = []
    while LAYER in vars(cls):
        layers.append(vars(cls)[LAYER])
        cls = cls.__bases__[1]
    return cls, layers[::-1]


# Every subclass ``_stack`` made, by (module, name, layer, base): stacking the
# same layers again gives back the very classes, so that a module that
# imported the patched class (vLLM's MTP draft: ``from .model import
# KimiMoE``) still holds the module's class after ``unregister()`` and
# ``register()``.
_STACKED: dict[tuple[str, str, type, type], type] = {}


def _stack(module: ModuleType, name: str, upstream: type, layers: list[type]) -> None:
    cls = upstream
    for layer in layers:
        key = (module.__name__, name, layer, cls)
        if key not in _STACKED:
            _STACKED[key] = type(
                name,
                (layer, cls),
                {
                    "__module__": module.__name__,
                    "__qualname__": upstream.__qualname__,
                    "__doc__": upstream.__doc__,
                    LAYER: layer,
                },
            )
        cls = _STACKED[key]
    setattr(module, name, cls)


def add_subclass_layer(module: ModuleType, name: str, layer: type) -> None:
    """Make ``module.name`` a subclass of itself with ``layer`` in front of it
    in the MRO (idempotent). Code that looks the class up in the module at
    call time builds the subclass; instances built before keep their class."""
    current = getattr(module, name)
    if issubclass(current, layer):
        return
    upstream, layers = _unstack(current)
    _stack(module, name, upstream, [*layers, layer])


def remove_subclass_layer(module: ModuleType, name: str, layer: type) -> None:
    """Undo ``add_subclass_layer(module, name, layer)``, keeping the other
    layers (idempotent)."""
    upstream, layers = _unstack(getattr(module, name))
    if layer in layers:
        layers.remove(layer)
        _stack(module, name, upstream, layers)


@contextmanager
def replaced_attributes(target: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``target`` for the block, then put back exactly what
    it held itself (a class's staticmethod stays one; an inherited attribute
    is inherited again)."""
    absent = object()
    saved = {name: vars(target).get(name, absent) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is absent:
                delattr(target, name)
            else:
                setattr(target, name, value)
