"""An in-place update that sends part of a Kimi-K3 MoE layer keeps the rest.

Used by strict expert loading (``strict_expert_loading``), which records
what an update hands each layer's loaders and calls ``prepared_update``
around the layer's preparation for its kernel. Patches nothing.

vLLM's layerwise reload prepares a layer an update sent part of from a
freshly materialised checkpoint-format copy (``finalize_layerwise_processing``:
what arrived, the rest zero or whatever the memory held) and copies every
tensor of the result into the kernel's own (``_copy_and_restore_kernel_tensors``):
experts the update did not send lose their values, with vLLM alone too. An RL
framework sending its weights in buckets, or some experts only, needs them
kept (vllm-project/vllm#54477 asks for selective reload).

Each routed-expert tensor the kernel reads is per expert (its first axis, one
entry per expert this GPU holds) and made from one of two groups of
checkpoint tensors: ``w13_*`` from every ``w1`` and ``w3`` tensor of the
expert (gate and up, fused), ``w2_*`` from every ``w2`` tensor (down). So:

- an expert sent a group whole gets the prepared result for it;
- an expert sent nothing of a group keeps, slice for slice, what the kernel's
  tensors of that group held before the update (vLLM keeps them aside,
  untouched, in ``LayerReloadingInfo.kernel_tensors`` until the copy): they
  are copied into the prepared tensors before vLLM copies those back, so the
  kernel's storage ends holding the old slices where nothing was sent;
- an expert sent part of a group (``w1`` without ``w3``, a weight without
  its scale) cannot be prepared right: the update is refused before anything
  of the layer is written, naming what is missing (and every layer the
  update left open gets back what it held: ``unfinished_update``);
- a tensor of a group without the expert axis (a layer-wide value some
  method derives) cannot be kept per expert: an update that sends part of
  that group is refused the same way.

What this takes: no memory beyond vLLM's own staging of the layer, and one
copy of the kept slices (at most the layer's kernel tensors).

vLLM's direct mode (``VLLM_RELOAD_MODE=direct``) writes into the kernel's
storage from ``begin``; nothing can be kept. A layer an update sent part of
(through its loaders, or a load plan's writes) is refused there at
``finish``, naming what is missing, instead of being prepared from bytes
nobody sent. So is a layer sent nothing whose kernel tensors vLLM's
``begin`` viewed back to the checkpoint's layout (a GPU holding none of the
experts an update sent, with expert parallelism): ``finish`` prepares every
layer again, that one from its kernel's bytes read as a checkpoint's. A
layer sent nothing whose tensors kept their layout is prepared as vLLM
prepares it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    put_back_open_layers,
    spans,
    what_the_engine_holds,
)

# the kernel tensors' prefix -> the checkpoint projections they are made from
GROUPS = {"w13": ("w1", "w3"), "w2": ("w2",)}


@dataclass
class Sent:
    """What an update handed one layer's loaders on memory (not the ``meta``
    counting pass): per global expert, the (projection, checkpoint suffix)
    of each tensor."""

    by_expert: dict[int, set[tuple[str, str]]] = field(
        default_factory=lambda: defaultdict(set)
    )

    def add(self, expert: int, projection: str, suffix: str) -> None:
        self.by_expert[expert].add((projection, suffix))

    def of(self, expert: int, group: str) -> set[tuple[str, str]]:
        return {(p, s) for p, s in self.by_expert.get(expert, ()) if p in GROUPS[group]}


@dataclass
class Delivery:
    """Per local expert, which groups an update sent none of, or part of
    (the rest it sent whole)."""

    none: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    # (expert, group, what of the group is missing)
    partial: list[tuple[int, str, list[str]]] = field(default_factory=list)


def delivery(
    sent: Sent, experts: Iterable[int], expert_tensors: list[tuple[str, str]]
) -> Delivery:
    """What ``sent`` delivered of each local expert's groups (``expert_tensors``:
    the (projection, suffix) of every checkpoint tensor an expert has)."""
    found = Delivery()
    for expert in experts:
        for group, projections in GROUPS.items():
            needed = {(p, s) for p, s in expert_tensors if p in projections}
            got = sent.of(expert, group)
            if got >= needed:
                continue
            if not got:
                found.none[group].append(expert)
            else:
                missing = sorted(f"{p}.{s}" for p, s in needed - got)
                found.partial.append((expert, group, missing))
    return found


def _describe_partial(partial: list[tuple[int, str, list[str]]], most: int = 8) -> str:
    shown = [
        f"expert {expert} without {', '.join(missing)}"
        for expert, _, missing in partial[:most]
    ]
    if len(partial) > most:
        shown.append(f"and {len(partial) - most} more")
    return "; ".join(shown)


def refuse(model: nn.Module | None, layer_name: str, why: str) -> None:
    """Raise the refusal of an update to ``layer_name``, every layer it left
    open in ``model`` (the module the update started on) given back what it
    held first."""
    put_back = put_back_open_layers(model)
    raise ValueError(
        f"Kimi-K3 weight update refused: layer {layer_name} {why}. "
        + what_the_engine_holds(put_back, "Send the update again with each unit whole")
    )


def expert_tensors_of(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's tensors its kernel reads per group (``w13_*``, ``w2_*``),
    parameters and buffers, by name."""
    tensors = dict(layer.named_parameters(recurse=False))
    tensors.update(layer.named_buffers(recurse=False))
    return {name: t for name, t in tensors.items() if name.split("_")[0] in GROUPS}


def missing_units(found: Delivery, every_expert: bool) -> str | None:
    """What ``found`` lacks of what the kernel takes, in words (None: it
    lacks nothing): part of a unit, or, where ``every_expert``, some experts
    with nothing at all."""
    if found.partial:
        return (
            "part of what its kernel keeps together (w1 and w3 with each of "
            "their tensors; w2 with each of its tensors): "
            + _describe_partial(found.partial)
        )
    if every_expert and any(found.none.values()):
        unsent = sorted({e for experts in found.none.values() for e in experts})
        groups = ", ".join(g for g, e in found.none.items() if e)
        return f"part of its experts (nothing of experts {spans(unsent)} for {groups})"
    return None


def check_before_preparing(
    model: nn.Module | None,
    layer_name: str,
    sent: Sent,
    found: Delivery,
    in_direct_mode: bool,
    viewed_back: bool = False,
) -> None:
    """Refuse, before the layer is prepared, an update its kernel cannot
    take as sent (see the module docstring). ``viewed_back``: vLLM's direct
    mode viewed the layer's kernel tensors back to the checkpoint's layout
    at the update's begin."""
    if viewed_back and not sent.by_expert:
        refuse(
            model,
            layer_name,
            "was sent none of its experts, and vLLM's direct reload prepares "
            "every layer again at its finish, this one from its kernel's bytes "
            "read as the checkpoint's (direct mode takes whole updates only)",
        )
    missing = missing_units(found, in_direct_mode and bool(sent.by_expert))
    if missing is None:
        return
    if not found.partial:  # experts missing, in direct mode
        missing += ", and vLLM's direct reload keeps nothing of what was not sent"
    refuse(model, layer_name, f"was sent {missing}")


def keep_unsent(
    model: nn.Module | None,
    layer: nn.Module,
    layer_name: str,
    previous: dict[str, torch.Tensor],
    found: Delivery,
    local_index: dict[int, int],
) -> None:
    """Copy into the just-prepared tensors of ``layer`` what the kernel's
    tensors (``previous``) held for every (expert, group) the update sent
    nothing of, so that vLLM's copy back leaves those slices as they were."""
    with torch.no_grad():
        for name, prepared in expert_tensors_of(layer).items():
            group = name.split("_")[0]
            unsent = found.none.get(group, [])
            if not unsent:
                continue
            old = previous.get(name)
            if old is None or old.shape != prepared.shape:
                refuse(
                    model,
                    layer_name,
                    f"was sent part of its experts, and its kernel's {name} "
                    "was not there before to keep the rest from",
                )
            if len(unsent) == len(local_index):  # nothing of the group sent
                prepared.copy_(old)
                continue
            if prepared.dim() == 0 or prepared.shape[0] != len(local_index):
                refuse(
                    model,
                    layer_name,
                    f"was sent some experts' {group} tensors only, and its "
                    f"kernel's {name} {tuple(prepared.shape)} holds no entry "
                    "per expert to keep the others in",
                )
            for expert in unsent:  # copy_: every dtype (FP8, E8M0) on every device
                prepared[local_index[expert]].copy_(old[local_index[expert]])


def layerwise_kernel_tensors(layer: nn.Module) -> dict[str, torch.Tensor] | None:
    """The kernel tensors vLLM's layerwise reload set aside for ``layer``
    (an update in progress), by name; None outside one."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    if info is None or info.kernel_tensors is None:
        return None
    parameters, buffers = info.kernel_tensors
    return {**parameters, **buffers}
