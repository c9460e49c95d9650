"""A weight-transfer engine's receive that fails leaves the Kimi-K3 model
serving what it held.

Patch ledger entry
------------------
Replaces
    ``vllm.distributed.weight_transfer.base.WeightTransferEngine.
    update_weights`` (a class attribute, which the NCCL, IPC and M2N engines
    inherit: a wrapper that calls it and returns what it returns). It acts
    only on the way out of an exception, and only where the engine's target
    model holds Kimi-K3 routed experts the plugin built.
Why
    The engines load an update in buckets: a start (the layerwise reload
    opens every layer), one ``update_weights`` per bucket (receive, then
    ``load_weights``), a finish. A receive that fails between two buckets
    (an NCCL broadcast timing out, a trainer dying mid-update) raises
    outside vLLM's loading, so nothing of the plugin's loading is on the
    stack (``model_executor.models.utils``), and vLLM's worker then ends the
    session (``Worker.update_weights``) with every layer the update opened
    still on ``meta``: the engine cannot serve, and the next update replays
    the dead one's buffered tensors with its own.
How
    On an exception out of ``update_weights``, every layer the update left
    open in the engine's target model (``engine.model``: the model, or the
    draft of a draft update) gets back the kernel tensors it held, its
    reload state reset (``model_loader.unfinished_update``; nothing in vLLM
    0.34's direct mode, which keeps nothing to go back to); one warning says
    so, and a note on the exception; the exception goes on unchanged. An
    update abandoned without an exception (no further bucket, no finish) is
    given back by the next update's start (``model_loader.reload.layerwise``).
Related PR
    As ``model_executor.models.utils``'s (the same put-back, for a failure
    outside vLLM's loading).
Delete when
    With ``model_executor.models.utils``'s patch.
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    put_back_after_failure,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

# What the patch replaces (``vllm_kimi_k3_moe.verification``).
TARGETS = ("vllm.distributed.weight_transfer.base:WeightTransferEngine.update_weights",)


def _putting_back(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def update_weights(engine: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return own(engine, *args, **kwargs)
        except BaseException as error:
            put_back_after_failure(engine.model, error)
            raise

    return update_weights


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    wrap_method(upstream.WeightTransferEngine, "update_weights", _putting_back)


def revert(upstream: ModuleType) -> None:
    """Put upstream's own ``WeightTransferEngine.update_weights`` back
    (idempotent)."""
    unwrap_method(upstream.WeightTransferEngine, "update_weights")
