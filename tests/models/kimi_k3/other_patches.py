"""Other code that patches vLLM at run time, as RL frameworks and other vLLM
plugins do (prime-rl wraps vLLM's layerwise reload, Parallax its weight
loaders): wrappers of the plugin's targets in the shapes such code takes,
with and without ``functools.wraps``, with the same and other parameters,
generators and plain functions. Each is installed as such code installs
it: the function the module or class holds is saved, and a wrapper that
calls it is put in its place (``install``); undone by ``monkeypatch``.

The observing ones count their calls (``Calls``) and hand on what vLLM's
function returns; ``dropping_materialize`` breaks what vLLM's reload
guarantees its loaders (the tensor it materialises carries the parameter's
attributes, its ``weight_loader`` among them).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
RELOAD_META = "vllm.model_executor.model_loader.reload.meta"
ROUTED_EXPERTS = "vllm.model_executor.layers.fused_moe.routed_experts"

# calls of each wrapper, by its name: which of them vLLM (or a proof) ran
Calls: Counter[str] = Counter()


def _count(name: str) -> None:
    Calls[name] += 1


def observing_get_all_weights(own: Callable) -> Callable:
    """The same parameters as vLLM's, no ``functools.wraps``, a generator."""

    def get_all_weights(self, model_config, model) -> Iterator[tuple[str, Any]]:
        _count("get_all_weights")
        # unpacks what it observes, as such code does (a name filter, a log)
        for name, tensor in own(self, model_config, model):  # noqa: UP028
            yield name, tensor

    return get_all_weights


def wrapped_get_all_weights(own: Callable) -> Callable:
    """``functools.wraps``, ``*args``, a plain function returning vLLM's
    generator."""

    @functools.wraps(own)
    def get_all_weights(*args: Any, **kwargs: Any) -> Any:
        _count("get_all_weights")
        return own(*args, **kwargs)

    return get_all_weights


def filling_materialize(own: Callable) -> Callable:
    """Another signature (no annotations), no ``functools.wraps``: fills
    what vLLM's returns (as 0.34's does) and returns it."""

    def materialize_meta_tensor(meta_tensor):
        _count("materialize_meta_tensor")
        tensor = own(meta_tensor)
        with torch.no_grad():
            tensor.zero_()
        return tensor

    return materialize_meta_tensor


def observing_materialize(own: Callable) -> Callable:
    """Another signature, no ``functools.wraps``: only counts."""

    def materialize_meta_tensor(meta_tensor):
        _count("materialize_meta_tensor")
        return own(meta_tensor)

    return materialize_meta_tensor


def wrapped_to_meta(own: Callable) -> Callable:
    """``functools.wraps``, ``*args``: only counts."""

    @functools.wraps(own)
    def to_meta_tensor(*args: Any, **kwargs: Any) -> Any:
        _count("to_meta_tensor")
        return own(*args, **kwargs)

    return to_meta_tensor


def dropping_materialize(own: Callable) -> Callable:
    """Materialises a bare tensor of the same shape and dtype, without the
    parameter's class and attributes: what vLLM's reload relies on is gone."""

    def materialize_meta_tensor(meta_tensor):
        _count("materialize_meta_tensor")
        return torch.empty_strided(
            tuple(meta_tensor.size()), meta_tensor.stride(), dtype=meta_tensor.dtype
        )

    return materialize_meta_tensor


def observing_get_quant_method(own: Callable) -> Callable:
    """A method of a class, the same parameters, no ``functools.wraps``."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        _count("_get_quant_method")
        return own(self, prefix, quant_config, moe_config)

    return _get_quant_method


# where each wrapper goes: (module, attribute path)
WHERE = {
    observing_get_all_weights: (DEFAULT_LOADER, "DefaultModelLoader.get_all_weights"),
    wrapped_get_all_weights: (DEFAULT_LOADER, "DefaultModelLoader.get_all_weights"),
    filling_materialize: (RELOAD_META, "materialize_meta_tensor"),
    observing_materialize: (RELOAD_META, "materialize_meta_tensor"),
    dropping_materialize: (RELOAD_META, "materialize_meta_tensor"),
    wrapped_to_meta: (RELOAD_META, "to_meta_tensor"),
    observing_get_quant_method: (ROUTED_EXPERTS, "RoutedExperts._get_quant_method"),
}


def install(monkeypatch: pytest.MonkeyPatch, make: Callable) -> str:
    """Put ``make(what is there)`` where ``WHERE`` says, as other code does;
    the target's name, as the plugin names targets."""
    import importlib

    module_name, path = WHERE[make]
    owner: Any = importlib.import_module(module_name)
    *classes, name = path.split(".")
    for part in classes:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, make(getattr(owner, name)))
    return f"{module_name}:{path}"


# how the plugin must name each wrapper: this module and the qualified name
# its code has (``functools.wraps`` gives the wrapper vLLM's ``__name__``)
NAMES = {
    observing_get_all_weights: "observing_get_all_weights.<locals>.get_all_weights",
    wrapped_get_all_weights: "wrapped_get_all_weights.<locals>.get_all_weights",
    filling_materialize: "filling_materialize.<locals>.materialize_meta_tensor",
    observing_materialize: "observing_materialize.<locals>.materialize_meta_tensor",
    dropping_materialize: "dropping_materialize.<locals>.materialize_meta_tensor",
    wrapped_to_meta: "wrapped_to_meta.<locals>.to_meta_tensor",
    observing_get_quant_method: (
        "observing_get_quant_method.<locals>._get_quant_method"
    ),
}


def name_of(make: Callable) -> str:
    return f"{__name__}.{NAMES[make]}"
