"""An in-place update starts clean, whatever the one before it left.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.model_loader.reload.layerwise.
    initialize_layerwise_reload`` (a module function; a wrapper that calls
    it) where vLLM calls it from: its own module, the ``reload`` package,
    ``reload.inplace`` (0.33's ``reload_weights``), ``reload.lifecycle``
    (0.34's ``start_reload``) and ``reload.torchao_decorator``, each bound
    by name at import. The weight-transfer engines, EPLB's recovery and RL
    frameworks reach it through the package.
Why
    An update that raised after its start and before its finish, outside
    anything of the plugin's (a trainer dying between two buckets, an NCCL
    receive timing out, a caller that never calls finish), leaves the
    layers it opened on ``meta`` with their buffered calls. vLLM's next
    start skips such layers (``info.can_load()``) and replays the dead
    update's buffered tensors with its own: sent again whole, a Kimi-K3
    layer then ends a mixture of the two (the plugin's record of what was
    sent, ``StrictExpertLoading.sent``, carried the dead update's too).
How
    Before vLLM's start runs, every layer of the module it starts on that
    an earlier update left open gets back the kernel tensors it held, its
    reload state reset (``model_loader.unfinished_update``), one warning
    saying so; after it, each Kimi-K3 routed-expert layer in that module
    starts a new record of what is sent (``StrictExpertLoading.
    start_update``), and learns the module the update runs on, where a
    refusal puts back what the update left open.
Related PR
    None upstream; vllm-project/vllm#48920 (a failed update is a mixture)
    and #51378 (modelwise transactions) are on the same ground.
Delete when
    vLLM's reload rolls back an update that did not finish, or refuses to
    start over one (re-check at every vLLM bump; on other vLLM code the
    plugin checks ``TARGETS`` first: ``vllm_kimi_k3_moe.verification``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    kimi_k3_loadings,
    layers_held,
    put_back_open_layers,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

logger = logging.getLogger("vllm.plugins.kimi_k3_moe")

START = "initialize_layerwise_reload"
# What the patch replaces (``vllm_kimi_k3_moe.verification``).
TARGETS = (f"vllm.model_executor.model_loader.reload.layerwise:{START}",)


def start_clean(model: nn.Module, started_by: str) -> None:
    """Before an update starts on ``model``: what an earlier one left open
    there is put back, and said once."""
    put_back = put_back_open_layers(model)
    if put_back.layers:
        logger.warning(
            "vllm-kimi-k3-moe: an earlier weight update did not finish: "
            "%s it had left open hold the weights they held before it (in the "
            "same memory) as %s starts.",
            layers_held(put_back),
            started_by,
        )


def _starting_clean(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def initialize_layerwise_reload(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        start_clean(model, "a new one")
        result = own(model, *args, **kwargs)
        for loading in kimi_k3_loadings(model):
            loading.start_update(model)
        return result

    return initialize_layerwise_reload


def apply(upstream: ModuleType) -> None:
    """Install the patch into one module that binds the function (its sites:
    ``vllm_kimi_k3_moe.PATCHES``) (idempotent)."""
    if hasattr(upstream, START):
        wrap_method(upstream, START, _starting_clean)


def revert(upstream: ModuleType) -> None:
    """Put the site's own ``initialize_layerwise_reload`` back (idempotent)."""
    unwrap_method(upstream, START)
