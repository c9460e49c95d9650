"""Changes to upstream classes and modules that can be undone exactly.

Three shapes of change, each with its inverse, used by the serving patches
and by the tools' temporary stand-ins alike:

- ``wrap_method`` / ``unwrap_method``: a wrapper around one method of a
  class, keeping upstream's own function on it (``kimi_k3_wraps``), so that
  applying twice wraps once and reverting puts back exactly the object the
  class held (a ``staticmethod`` or ``classmethod`` stays one; an inherited
  method is inherited again).
- ``add_subclass_layer`` / ``remove_subclass_layer``: a module's class
  replaced by a subclass of itself with one more base in front. Several
  patches may each add their own layer to the same class and each remove
  only its own; ``upstream_class`` finds the class upstream defined.
- ``replaced_attributes``: attributes set for the duration of a ``with``
  block, then put back as the target held them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

WRAPPED = "kimi_k3_wraps"
# Set on a class made by ``add_subclass_layer``: the base it put in front.
LAYER = "kimi_k3_layer"


def _function_of(attribute: Any) -> Any:
    """The function inside a ``staticmethod``/``classmethod``, else itself."""
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    return attribute


def wrap_method(cls: type, name: str, make_wrapper: Callable[[Any], Any]) -> None:
    """Replace ``cls.name`` by ``make_wrapper(own)`` unless already wrapped.

    ``own`` is upstream's function (unbound: a ``staticmethod``'s or
    ``classmethod``'s function); the wrapper is put back in the same kind
    of descriptor."""
    attribute = inspect.getattr_static(cls, name)
    own = _function_of(attribute)
    if hasattr(own, WRAPPED):
        return
    wrapper = make_wrapper(own)
    defined_here = name in vars(cls)
    setattr(wrapper, WRAPPED, (attribute, defined_here))
    if isinstance(attribute, (staticmethod, classmethod)):
        wrapper = type(attribute)(wrapper)
    setattr(cls, name, wrapper)


def unwrap_method(cls: type, name: str) -> None:
    """Undo ``wrap_method`` on ``cls.name`` (nothing if it is not wrapped)."""
    wrapped = getattr(_function_of(inspect.getattr_static(cls, name)), WRAPPED, None)
    if wrapped is None:
        return
    attribute, defined_here = wrapped
    if defined_here:
        setattr(cls, name, attribute)
    else:
        delattr(cls, name)


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
