"""Kimi-K3 NVIDIA: regular FusedMoE gets the logical MoE size; the backend pads it.

Patch ledger entry
------------------
Replaces
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE`` (by a subclass of itself).
    Nothing else in that module is touched: the fix lives in the class vLLM's
    decoder and MTP layers build, so it holds whatever the module's
    ``FusedMoEFactory`` global is later rebound to (a profiler, another
    plugin, a test double).
Why
    vLLM 0.33.0 and 0.34.0 pad ``moe_intermediate_size`` at model level to
    ``min_moe_intermediate_per_partition`` (256) per TP rank and hands that to
    the regular FusedMoE path. At TP32 the logical slice is 3072 / 32 = 96 and
    the MXFP4 Marlin kernel needs 128, but the layer allocates 256: routed
    experts take ~120.5 GB per GPU instead of ~60.3 GB, more than a 96 GB GPU
    holds.
How
    ``padded_moe_intermediate_size`` becomes a property of a subclass layer
    (``patching.add_subclass_layer``) put in front of upstream ``KimiMoE``
    (``vllm_kimi_k3_moe.models.kimi_k3.kimi_moe``, shared with the AMD patch).
    Upstream ``KimiMoE.__init__`` assigns it (the model-level value, kept),
    then reads it twice: as the regular ``FusedMoEFactory``'s
    ``intermediate_size`` and in the guard of its post-construction block
    (zeroing ``w13``/``w2``, assigning
    ``intermediate_size_per_partition_unpadded``). While ``__init__`` runs the
    property reads as the logical ``config.moe_intermediate_size``, so the
    factory gets 3072 and the block does not run; afterwards it reads the
    model-level value again, which MegaMoE (``DeepGemmMegaMoEExperts``,
    expert parallel only, where the two are equal) keeps consuming. The
    per-rank partition each quantization method then allocates is chosen in
    ``vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts``
    from the build recorded here (logical and model-level size).
    ROCm and XPU build Kimi-K3's MoE from ``amd/linear.py``: its own patch
    (``vllm_kimi_k3_moe.models.kimi_k3.amd.linear``).
Related PR
    vLLM "[Bugfix][Model] Kimi-K3 NVIDIA: delegate regular FusedMoE padding to
    the selected quantization backend" (builds on #51131, overlaps #50928).
Delete when
    vLLM ships that PR: the first release whose NVIDIA ``KimiMoE`` passes
    ``moe_intermediate_size`` to ``FusedMoEFactory``. On that vLLM
    ``in_vllm`` sees it and the plugin leaves this fix off; on any other
    vLLM code it checks ``TARGETS`` before patching
    (``vllm_kimi_k3_moe.verification``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.models.kimi_k3.kimi_moe import (
    BackendPaddedKimiMoE,
    factory_gets_logical_size,
    uses_padded_size,
)
from vllm_kimi_k3_moe.patching import add_subclass_layer, remove_subclass_layer

KIMI_MOE_INIT = "vllm.models.kimi_k3.nvidia.model:KimiMoE.__init__"
# What the patch replaces or relies on (``vllm_kimi_k3_moe.verification``).
TARGETS = (KIMI_MOE_INIT,)


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    add_subclass_layer(upstream, "KimiMoE", BackendPaddedKimiMoE)


def revert(upstream: ModuleType) -> None:
    """Take the patch out of upstream's ``KimiMoE`` (idempotent)."""
    remove_subclass_layer(upstream, "KimiMoE", BackendPaddedKimiMoE)


def relied_on(find: Callable[[str], Any]) -> str | None:
    """Upstream ``KimiMoE.__init__`` sets and reads ``padded_moe_intermediate_size``
    (the attribute the patch answers as a property)."""
    return uses_padded_size(KIMI_MOE_INIT, find)


def in_vllm(find: Callable[[str], Any]) -> str | None:
    """vLLM's own ``KimiMoE`` hands its regular ``FusedMoEFactory`` another
    size than the model-level padded one: the upstream fix."""
    return factory_gets_logical_size(KIMI_MOE_INIT)
