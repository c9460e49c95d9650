"""Wrap a method of an upstream class so the wrapping can be undone.

A patch that wraps ``cls.name`` keeps upstream's own function on the wrapper
(``kimi_k3_wraps``): applying twice wraps once, and reverting puts back
exactly what was there, whether the class defined it or inherited it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WRAPPED = "kimi_k3_wraps"


def wrap_method(cls: type, name: str, make_wrapper: Callable[[Any], Any]) -> None:
    """Replace ``cls.name`` by ``make_wrapper(own)`` unless already wrapped."""
    own = getattr(cls, name)
    if hasattr(own, WRAPPED):
        return
    wrapper = make_wrapper(own)
    setattr(wrapper, WRAPPED, (own, name in cls.__dict__))
    setattr(cls, name, wrapper)


def unwrap_method(cls: type, name: str) -> None:
    """Undo ``wrap_method`` on ``cls.name`` (nothing if it is not wrapped)."""
    wrapped = getattr(getattr(cls, name), WRAPPED, None)
    if wrapped is None:
        return
    own, defined_here = wrapped
    if defined_here:
        setattr(cls, name, own)
    else:
        delattr(cls, name)
