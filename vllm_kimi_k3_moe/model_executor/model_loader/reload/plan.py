"""What a vLLM 0.34 load plan writes counts as sent to the Kimi-K3 routed
experts, and a plan that declares part of what a kernel keeps together is
refused before anything is written.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.model_loader.reload.plan.plan_loads`` (a module
    function, also bound by name in the ``reload`` package, where the NCCL
    weight-transfer engine imports it) and ``LoadPlan.get_dest`` (a class
    attribute): wrappers that call them and return what they return. vLLM
    0.33 has no load plans: nothing to patch there (``ONLY_WHERE``).
Why
    A load plan copies each checkpoint tensor it can straight into the
    storage its trace found (``load_planned``, ``get_dest``), with no
    ``weight_loader`` call; the rest go through the loaders. vLLM's direct
    mode keeps nothing of what an update does not send, so the plugin
    refuses a layer an update sent part of (``partial_updates``), judged
    from what the update handed the loaders: through a plan it saw only the
    fallbacks (FP8 blocks' and NVFP4's scales, cast on the way), took every
    whole FP8-block or NVFP4 update for part of one and refused it, where
    vLLM alone finishes. And the plan's own trace, which hands each loader a
    data-free tensor, counted as sent.
How
    While ``plan_loads`` traces, each Kimi-K3 loader notes which of its
    slices each name lands in (``StrictExpertLoading.planned``; the trace
    is not counted as sent). When the plan is made, each Kimi-K3 layer of
    the model is held to what the plan's metadata declares for this GPU:
    each expert's units (w1 and w3 with all their tensors, w2 with all of
    its) whole, and every expert or none; otherwise the plan is refused
    with the names missing, before any update is written through it. The
    names the plan writes directly are kept with the plan; ``get_dest``
    handing out the destinations of one counts it as sent to its layer, as
    a loader call would.
Related PR
    None upstream: vLLM's plan assumes an update delivers every tensor of a
    layer whose preparation re-lays it out (``reload/direct.py``'s delivery
    contract, "not checked here").
Delete when
    With the strict expert loader.
Verified against
    vLLM 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``; 0.33.0 has no load
    plans): CI runs the whole test suite on each.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partial_updates import (
    Sent,
    delivery,
    missing_units,
)
from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    kimi_k3_loadings,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

PLAN = "plan_loads"
_PLAN_MODULE = "vllm.model_executor.model_loader.reload.plan"
# What the patch replaces (``vllm_kimi_k3_moe.verification``), and the vLLM
# module without which there is nothing to patch (vLLM 0.33).
TARGETS = (f"{_PLAN_MODULE}:{PLAN}", f"{_PLAN_MODULE}:LoadPlan.get_dest")
ONLY_WHERE = _PLAN_MODULE

# id(plan) -> checkpoint name -> (its layer's ledger, its slice there), for
# the names the plan writes on this GPU without a loader (or none of: whole
# scale groups leave some GPUs no rows); dropped with the plan
_DIRECT_WRITES: dict[int, dict[str, tuple[Any, Any]]] = {}


def _held_to_its_metadata(plan: Any, loading: Any) -> None:
    """Refuse ``plan`` where its metadata declares part of what ``loading``'s
    kernel keeps together on this GPU; note the names it writes directly."""
    planned, loading.planned = loading.planned, {}
    declared = Sent()
    writes = _DIRECT_WRITES.setdefault(id(plan), {})
    for name, expert_slice in planned.items():
        entry = plan.entries.get(name)
        if entry is None:
            continue
        declared.add(
            expert_slice.expert_id, expert_slice.projection, expert_slice.suffix
        )
        if entry.writes is not None:  # direct (or nothing on this GPU)
            writes[name] = (loading, expert_slice)  # None: a fallback, loaded
    if not declared.by_expert:
        return  # the plan sends this layer nothing
    found = delivery(declared, loading.local_experts(), loading.expert_tensors)
    missing = missing_units(found, every_expert=True)
    if missing is not None:
        raise ValueError(
            f"Kimi-K3 load plan refused: layer {loading.sent_prefix.rstrip('.')} "
            f"is declared in the plan's metadata with {missing}, and vLLM's direct "
            "reload keeps nothing of what an update does not send. Declare every "
            "tensor of each layer and initialise the weight-transfer engine "
            "again; the model must not serve until a whole update lands (no "
            "restart needed)."
        )


def _planning(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def plan_loads(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        loadings = kimi_k3_loadings(model)
        for loading in loadings:
            loading.planned = {}
        plan = own(model, *args, **kwargs)
        _DIRECT_WRITES.pop(id(plan), None)
        weakref.finalize(plan, _DIRECT_WRITES.pop, id(plan), None)
        for loading in loadings:
            _held_to_its_metadata(plan, loading)
        return plan

    return plan_loads


def _counting_writes(own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def get_dest(plan: Any, name: str) -> Any:
        dest = own(plan, name)
        # an empty list is this GPU's share of the name, none of its rows:
        # delivered all the same
        written = _DIRECT_WRITES.get(id(plan), {}).get(name)
        if dest is not None and written is not None:
            loading, expert_slice = written
            loading.sent.add(
                expert_slice.expert_id, expert_slice.projection, expert_slice.suffix
            )
        return dest

    return get_dest


def apply(upstream: ModuleType) -> None:
    """Install the patch into one module that binds ``plan_loads`` (its
    sites: ``vllm_kimi_k3_moe.PATCHES``), and ``LoadPlan.get_dest`` with
    ``reload.plan`` (idempotent)."""
    if hasattr(upstream, PLAN):
        wrap_method(upstream, PLAN, _planning)
    if upstream.__name__ == _PLAN_MODULE:
        wrap_method(upstream.LoadPlan, "get_dest", _counting_writes)


def revert(upstream: ModuleType) -> None:
    """Put the site's own ``plan_loads`` (and ``LoadPlan.get_dest``) back
    (idempotent)."""
    unwrap_method(upstream, PLAN)
    if upstream.__name__ == _PLAN_MODULE:
        unwrap_method(upstream.LoadPlan, "get_dest")
