"""A weight update that fails midway leaves the Kimi-K3 model serving what
it held, whatever failed.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.models.utils.AutoWeightsLoader.load_weights`` (a
    class attribute; a wrapper that calls it and returns what it returns).
    It acts only on the way out of an exception, and only for a module
    holding Kimi-K3 routed experts the plugin built: every other model's
    loading is as upstream.
Why
    Kimi-K3's models (NVIDIA's and AMD's) load every checkpoint tensor of an
    update through one ``AutoWeightsLoader.load_weights`` call: vLLM's
    ``reload_weights`` (both releases), the weight-transfer engines' calls
    between a start and a finish (one per bucket), EPLB's recovery. Where
    the weights' source raises midway (a trainer dying mid-broadcast, a
    shard cut short on a network filesystem, a receive timing out) or one
    of vLLM's loaders raises, nothing puts back the layers the update had
    opened (``reload/inplace.py`` has no ``finally``): they stay on
    ``meta``, the engine cannot serve, and the next update replays the
    failed one's buffered tensors with its own.
How
    On an exception out of the outermost such call (nested ones, a model's
    ``load_weights`` calling its submodules', leave it to the outermost)
    for a module holding Kimi-K3 routed experts, every layer of that module
    the update left open gets back the kernel tensors it held, its reload
    state reset (``model_loader.unfinished_update``; nothing in vLLM 0.34's
    direct mode, which keeps nothing to go back to); one warning says so,
    and a note on the exception too; the exception goes on unchanged.
Related PR
    None upstream; vllm-project/vllm#48920 (a failed update is a mixture)
    and #51378 (modelwise transactions) are on the same ground.
Delete when
    vLLM's reload rolls back an update that fails (re-check at every vLLM
    bump; on other vLLM code the plugin checks ``TARGETS`` first:
    ``vllm_kimi_k3_moe.verification``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    put_back_after_failure,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

# What the patch replaces (``vllm_kimi_k3_moe.verification``).
TARGETS = ("vllm.model_executor.models.utils:AutoWeightsLoader.load_weights",)

_depth = threading.local()  # nested calls in this thread


def _putting_back(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def load_weights(loader: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        try:
            return own(loader, *args, **kwargs)
        except BaseException as error:
            if depth == 0:
                put_back_after_failure(loader.module, error)
            raise
        finally:
            _depth.value = depth

    return load_weights


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    wrap_method(upstream.AutoWeightsLoader, "load_weights", _putting_back)


def revert(upstream: ModuleType) -> None:
    """Put upstream's own ``AutoWeightsLoader.load_weights`` back (idempotent)."""
    unwrap_method(upstream.AutoWeightsLoader, "load_weights")
