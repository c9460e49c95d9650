"""An in-place update in vLLM 0.34's direct mode starts a new record of what
is sent to each Kimi-K3 routed-expert layer.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.model_loader.reload.direct.begin_direct_reload``
    (a module function; a wrapper that calls it) where vLLM calls it from:
    its own module and ``reload.lifecycle`` (``start_reload`` with
    ``VLLM_RELOAD_MODE=direct``), which binds it by name at import. vLLM
    0.33 has no direct mode: nothing to patch there (``ONLY_WHERE``).
Why
    In direct mode the loaders write into the kernel's storage from the
    update's start, and nothing can be kept of what an update does not
    send: the plugin refuses, at the update's finish, a layer sent part of
    its experts (``partial_updates``), from its record of what was sent.
    An update that raised before its finish (the weights' source dying
    midway) never cleared that record: the next update, sent part of a
    layer, would have looked whole with the dead one's tensors, and been
    prepared from bytes nobody sent this time. And a layer an update sends
    nothing (a GPU holding none of the experts a partial update sent) is
    prepared again at the finish from whatever its storage holds: where
    ``begin`` viewed its kernel tensors back to the checkpoint's layout,
    that is the kernel's bytes read as a checkpoint's.
How
    After vLLM's ``begin_direct_reload`` returns (it refuses with the model
    untouched, or begins), each Kimi-K3 routed-expert layer of the model
    starts a new record (``StrictExpertLoading.start_update``), noting
    whether ``begin`` changed how any of its kernel tensors lays its
    storage out (viewed it back); the finish refuses such a layer sent
    nothing.
Related PR
    None upstream: vLLM's direct mode keeps no state across updates of its
    own (``reload/direct.py``: no rollback by design, the next full update
    repairs the model).
Delete when
    With the strict expert loader.
Verified against
    vLLM 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``; 0.33.0 has no direct
    mode): CI runs the whole test suite on each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partial_updates import (
    expert_tensors_of,
)
from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    kimi_k3_layers,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

BEGIN = "begin_direct_reload"
_DIRECT = "vllm.model_executor.model_loader.reload.direct"
# What the patch replaces (``vllm_kimi_k3_moe.verification``), and the vLLM
# module without which there is nothing to patch (vLLM 0.33).
TARGETS = (f"{_DIRECT}:{BEGIN}",)
ONLY_WHERE = _DIRECT


def _layouts(layer: nn.Module) -> dict[str, tuple[Any, ...]]:
    """How each kernel tensor of ``layer`` lays its storage out."""
    return {
        name: (t.shape, t.stride(), t.dtype, t.storage_offset(), t.data_ptr())
        for name, t in expert_tensors_of(layer).items()
    }


def _recording_anew(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def begin_direct_reload(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        layers = kimi_k3_layers(model)
        before = [_layouts(layer) for layer, _ in layers]
        result = own(model, *args, **kwargs)
        for (layer, loading), held in zip(layers, before, strict=True):
            loading.start_update(model, viewed_back=_layouts(layer) != held)
        return result

    return begin_direct_reload


def apply(upstream: ModuleType) -> None:
    """Install the patch into one module that binds the function (its sites:
    ``vllm_kimi_k3_moe.PATCHES``) (idempotent)."""
    if hasattr(upstream, BEGIN):
        wrap_method(upstream, BEGIN, _recording_anew)


def revert(upstream: ModuleType) -> None:
    """Put the site's own ``begin_direct_reload`` back (idempotent)."""
    unwrap_method(upstream, BEGIN)
