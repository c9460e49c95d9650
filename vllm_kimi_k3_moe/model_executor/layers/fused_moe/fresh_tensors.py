"""Kimi-K3 routed experts: a tensor vLLM allocates anew to reload into is zero
before its first write, so that its pads are zero after every update.

Used by the ``routed_experts`` patch, for every layer it builds inside a
``KimiMoE`` (any method, any layout). vLLM's loaders write only the rows a
GPU holds of the checkpoint; the pad rows past them are zero only where
someone zeroed them. The plugin zeroes them when it builds the layer
(``routed_experts.zero_expert_tensors``), but an in-place update loads into
other tensors: vLLM's layerwise reload (both releases' ``reload_weights``,
0.34's ``start_reload`` in its default mode, the weight-transfer engines,
EPLB's recovery of experts from disk) puts each parameter back on the
``meta`` device in checkpoint format, then materialises a new tensor
(``reload.meta.materialize_meta_tensor``), replays the loaders into it,
prepares it for the kernel and copies the result into the kernel's storage.
vLLM 0.33 materialises with ``torch.empty_strided`` (whatever the memory
held: at TP32 the 160 pad rows of 256 reach Marlin's repack, and the
forward is NaN, with vLLM alone too); 0.34 zero-fills it. An online method
at a cold start loads the same way, from ``meta``.

So each per-expert parameter's ``weight_loader`` (an attribute, which vLLM
carries over to the tensors it restores and materialises) zeroes the
tensor it is handed, once, before the first write, unless it is a tensor
the layer was built with (zeroed there, and kept by 0.34's direct reload,
which views the same storage back and zero-fills the pads itself:
``padding_fill_params``) or is on ``meta`` (vLLM's first pass counting
what a loader writes). Zeroing a tensor just materialised loses nothing:
every byte of it the update needs is written by the loaders that follow.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

# id -> weak reference of every tensor known not to need zeroing: built with
# the layer, or zeroed once since it was materialised. By identity: vLLM's
# copies carry the attributes (``__dict__``) of the tensor they copy.
_KNOWN: dict[int, weakref.ref] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    if _KNOWN.get(key) is ref:
        del _KNOWN[key]


def _know(tensor: torch.Tensor) -> None:
    key = id(tensor)
    _KNOWN[key] = weakref.ref(tensor, functools.partial(_forget, key))


def _known(tensor: torch.Tensor) -> bool:
    ref = _KNOWN.get(id(tensor))
    return ref is not None and ref() is tensor


def expert_parameters(layer: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The layer's per-expert weight and scale tensors (``[experts, rows,
    cols]`` ``w13_*`` / ``w2_*``): the ones with pad rows."""
    return {
        name: param
        for name, param in layer.named_parameters(recurse=False)
        if name.startswith(("w13_", "w2_")) and param.dim() == 3
    }


def zero_fresh_tensors_before_loading(layer: torch.nn.Module) -> None:
    """Wrap the ``weight_loader`` of each of ``layer``'s per-expert
    parameters (just created) so that a tensor other than the one built
    here is zeroed before its first write."""
    for param in expert_parameters(layer).values():
        _know(param)
        own = getattr(param, "weight_loader", None)
        if own is not None:
            param.weight_loader = zeroing_first(own)


def zeroing_first(own: Callable[..., Any]) -> Callable[..., Any]:
    """``own``, zeroing a tensor not known here before its first write."""

    @functools.wraps(own)
    def weight_loader(param: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not param.is_meta and not _known(param):
            with torch.no_grad():
                param.data.zero_()
            _know(param)
        return own(param, *args, **kwargs)

    return weight_loader
