"""Kimi-K3 loading errors name the checkpoint's own tensor keys; an update
from a checkpoint directory is held to its shard headers first.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.model_loader.default_loader.DefaultModelLoader.
    get_all_weights`` (class attribute; a generator that yields what upstream
    yields, unchanged and in order; or what another wrapper installed before
    the plugin yields: it calls whatever the class held).
Why
    A malformed checkpoint an update loads from disk should change nothing;
    the loaders see its tensors one by one. And by the time a tensor
    reaches an expert parameter's ``weight_loader``,
    vLLM has renamed it twice (the model's ``hf_to_vllm_mapper``:
    ``language_model.layers.`` -> ``language_model.model.layers.``; native
    MXFP4: ``.weight_packed`` -> ``.weight``). An error naming the renamed
    tensor sends an operator looking for a key the checkpoint's index does
    not have.
How
    An in-place update from a checkpoint directory is first held to its
    shard headers, before the first tensor is read (``update_headers``).
    The wrapper remembers the last (key, tensor) it yielded. Loading is one
    pass over that generator, and vLLM hands each expert tensor object on to
    its ``weight_loader`` before asking for the next, so the strict expert
    loader (``vllm_kimi_k3_moe.model_executor.layers.fused_moe.
    routed_experts``) recovers the key by identity of the tensor it was
    given; anything else (another loader, a transformed tensor) falls back
    to vLLM's name.
Related PR
    None upstream: vLLM's loaders do not pass the checkpoint key along.
Delete when
    With the strict expert loader, or when vLLM's weight loaders receive the
    checkpoint key (re-check at every vLLM bump; on other vLLM code the
    plugin checks ``TARGETS`` first: ``vllm_kimi_k3_moe.verification``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator
from types import ModuleType
from typing import Any

from torch import nn

from vllm_kimi_k3_moe.model_executor.model_loader.update_headers import (
    hold_update_to_headers,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

# What the patch replaces (``vllm_kimi_k3_moe.verification``).
TARGETS = (
    "vllm.model_executor.model_loader.default_loader:"
    "DefaultModelLoader.get_all_weights",
)


def relied_on(find: Callable[[str], Any]) -> str | None:
    """Upstream's ``get_all_weights`` is a generator (the wrapper is one)."""
    if not inspect.isgeneratorfunction(find(TARGETS[0])):
        return f"{TARGETS[0]} is no longer a generator"
    return None


class _LastYielded:
    """The (key, tensor) the wrapped generator yielded last, in this process."""

    key: str | None = None
    tensor: Any = None


def checkpoint_key_of(tensor: Any) -> str | None:
    """The checkpoint key ``tensor`` was read under, if it is the tensor the
    default loader yielded last."""
    if tensor is not None and tensor is _LastYielded.tensor:
        return _LastYielded.key
    return None


def _remembering_keys(own: Callable) -> Callable:
    @functools.wraps(own)
    def get_all_weights(
        self: Any, *args: Any, **kwargs: Any
    ) -> Generator[Any, None, None]:
        model_config = kwargs.get("model_config", args[0] if args else None)
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        if isinstance(model, nn.Module):  # before the first tensor is read
            hold_update_to_headers(model_config, model)
        try:
            # what it yields, as it yields it: a (key, tensor) remembered,
            # anything else another wrapper yields handed on as it is
            for item in own(self, *args, **kwargs):
                if isinstance(item, tuple) and len(item) == 2:
                    _LastYielded.key, _LastYielded.tensor = item
                yield item
        finally:
            _LastYielded.key, _LastYielded.tensor = None, None

    return get_all_weights


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    wrap_method(upstream.DefaultModelLoader, "get_all_weights", _remembering_keys)


def revert(upstream: ModuleType) -> None:
    """Put upstream's own ``get_all_weights`` back (idempotent)."""
    unwrap_method(upstream.DefaultModelLoader, "get_all_weights")
