"""A weight update that does not finish leaves the model serving what it held.

Used by strict expert loading when it refuses a tensor of an in-place update
(``vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading``),
by the check of an update's shard headers (``update_headers``), and by the
patches on vLLM's update lifecycle (``vllm_kimi_k3_moe.model_executor.
model_loader.reload``, ``vllm_kimi_k3_moe.model_executor.models.utils``):
when an update fails for any reason, and when the next one starts after one
that never finished. Patches nothing.

vLLM's layerwise reload (both releases' ``reload_weights`` and weight-transfer
engines, 0.34's ``start_reload``/``finish_reload`` in its default mode,
EPLB's recovery from disk) opens every layer it updates: the tensors the
kernels read (``LayerReloadingInfo.kernel_tensors``) are set aside, untouched,
and the layer gets checkpoint-format parameters on the ``meta`` device, whose
loaders buffer what arrives until the layer is whole; only then is it
materialised, prepared for its kernel and copied into the set-aside tensors.
An exception out of a loader or out of the weights' source ends
``load_weights`` with no ``finally``: every layer still open stays on
``meta`` (the model cannot run), and the next update skips them in
``initialize_layerwise_reload`` (``info.can_load()``), replaying the failed
update's buffered calls with its own (``reload/inplace.py``,
``reload/layerwise.py``).

So every open layer that an update opened (one with kernel tensors set
aside; a cold start's online layer has none) within the model is given its
kernel tensors back, the very objects, by vLLM's own
``_place_kernel_tensors``, and its reload state is reset: it holds exactly
what it held before, in the same storage (CUDA graphs captured after the
first load keep reading it), and the next update opens it afresh. Layers
the update already finished hold the update. This is vLLM's own fallback
for a layer an update sent nothing (``finalize_layerwise_processing``),
taken for every layer the failed update left open (the next update's start
begins a new record of what is sent: ``StrictExpertLoading.start_update``).
Only the model the update was for is touched: another
model in the same process (another engine's, a draft updated on its own)
keeps its update open.

vLLM's direct mode (``VLLM_RELOAD_MODE=direct``, 0.34) has no rollback by
design (``reload/direct.py``): ``begin`` views the kernel tensors back to
their checkpoint layout, so the previous weights are gone once it returns.
There a refusal says that the model must not serve until a whole update
lands; the next one repairs it (``begin`` again, ``finish`` prepares it).
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

logger = logging.getLogger("vllm.plugins.kimi_k3_moe")

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
# What a Kimi-K3 RoutedExperts of the plugin carries (strict expert loading)
EXPERT_LOADING = "kimi_k3_expert_loading"


@dataclass
class PutBack:
    """What an update that did not finish left: the layers given back what
    they held."""

    layers: list[nn.Module] = field(default_factory=list)
    direct: bool = False  # in vLLM's direct mode: nothing could be put back


def direct_mode() -> bool:
    """Whether updates reload in vLLM's direct mode (0.34; 0.33 has none)."""
    try:
        from vllm.model_executor.model_loader.reload.direct import (
            direct_reload_enabled,
        )
    except ImportError:
        return False
    return direct_reload_enabled()


def kimi_k3_loadings(model: nn.Module) -> list:
    """The strict-loading ledgers of the Kimi-K3 routed experts in ``model``."""
    return [loading for _, loading in kimi_k3_layers(model)]


def kimi_k3_layers(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Each Kimi-K3 routed-expert layer of ``model``, with its ledger."""
    return [
        (module, loading)
        for module in model.modules()
        if (loading := getattr(module, EXPERT_LOADING, None)) is not None
    ]


def put_back_open_layers(model: nn.Module | None) -> PutBack:
    """Give every layer of ``model`` an update left open its kernel tensors
    back and close its reload state (see the module docstring); ``None``:
    every open layer of the process (where the model is not known)."""
    if direct_mode():
        return PutBack(direct=True)
    layerwise = importlib.import_module(_LAYERWISE)
    layers: Iterable[nn.Module] = (
        list(layerwise.LAYERWISE_INFO.keys()) if model is None else model.modules()
    )
    put_back = PutBack()
    for layer in layers:
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.kernel_tensors is None:
            continue  # closed, or a cold start's (online) layer
        layerwise._place_kernel_tensors(layer, info)
        holds = any(info.kernel_tensors)  # a layer of tensors, not a container
        info.reset()
        if holds:
            put_back.layers.append(layer)
    if put_back.layers:
        _update_no_longer_active()
    return put_back


def put_back_after_failure(model: nn.Module, error: BaseException) -> None:
    """An update of ``model`` raised ``error`` on its way (the patches on
    vLLM's ``AutoWeightsLoader.load_weights`` and the weight-transfer
    engines' ``update_weights``): every layer it left open in ``model``, if
    ``model`` holds Kimi-K3 routed experts, given back what it held, said in
    one warning and in a note on ``error``. Another model is untouched."""
    if not kimi_k3_loadings(model):
        return
    put_back = put_back_open_layers(model)
    if not put_back.layers:
        return  # a cold start, a refusal that put back already, direct mode
    said = (
        f"vllm-kimi-k3-moe: the weight update failed ({type(error).__name__}): "
        f"{layers_held(put_back)} it had not finished hold the weights they "
        "held before it, in the same memory; layers it finished hold the "
        "update. Send the whole update again (no restart needed)."
    )
    logger.warning(said)
    error.add_note(said)


def _update_no_longer_active() -> None:
    """vLLM 0.34 marks an update active from ``start_reload`` to
    ``finish_reload`` (``lifecycle.weight_update_active``, read by models
    that skip completeness checks meanwhile); the failed update's finish
    never comes."""
    try:
        from vllm.model_executor.model_loader.reload import lifecycle
    except ImportError:
        return
    if hasattr(lifecycle, "_weight_update_active"):
        lifecycle._weight_update_active = False


def what_the_engine_holds(put_back: PutBack, remedy: str) -> str:
    """The end of a refusal's message: what the model holds now, and what
    to do (``remedy``, where the engine serves on)."""
    if put_back.direct:
        return (
            "vLLM's direct reload (VLLM_RELOAD_MODE=direct) keeps no previous "
            "weights to go back to: the model holds part of this update and "
            "must not serve until a whole update lands. Send the whole update "
            "again (no restart needed)."
        )
    if not put_back.layers:
        return "Nothing was written; every layer holds what it held."
    return (
        f"Nothing of it was written. The engine serves on: {layers_held(put_back)} "
        "this update had not finished hold the weights they held before it, in "
        f"the same memory; layers it finished before hold the update. {remedy} "
        "(no restart needed)."
    )


def layers_held(put_back: PutBack) -> str:
    """The layers ``put_back`` gave back, in words: ``Kimi-K3 MoE layers 1-3
    and 14 other layers``."""
    numbers = sorted(
        _layer_number(layer.layer_name)
        for layer in put_back.layers
        if hasattr(layer, EXPERT_LOADING)
    )
    others = len(put_back.layers) - len(numbers)
    if not numbers:
        return f"{others} layers"
    moe = f"Kimi-K3 MoE layer{'s' if len(numbers) != 1 else ''} {spans(numbers)}"
    return f"{moe} and {others} other layers" if others else moe


def _layer_number(layer_name: str) -> int:
    found = re.search(r"\.layers\.(\d+)\.", layer_name)
    return int(found.group(1)) if found else -1


def spans(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def name_as_sent(vllm_name: str, kimi_moe_module: str) -> str:
    """``vllm_name`` as the checkpoint (and an update's caller) names it:
    the Kimi-K3 model's ``hf_to_vllm_mapper`` prefixes undone (the model of
    the package ``kimi_moe_module`` is in, as imported); unchanged where no
    prefix maps to it."""
    package = kimi_moe_module.rpartition(".")[0]
    model = sys.modules.get(f"{package}.model")
    model_class = getattr(model, "KimiK3ForConditionalGeneration", None)
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    prefixes = getattr(mapper, "orig_to_new_prefix", {}) or {}
    for orig, new in sorted(prefixes.items(), key=lambda p: -len(p[1] or "")):
        if new and vllm_name.startswith(new):
            return orig + vllm_name[len(new) :]
    return vllm_name
