"""Kimi-K3 on AMD (ROCm) and Intel (XPU): regular FusedMoE gets the logical MoE
size; the backend vLLM selects there pads it.

Patch ledger entry
------------------
Replaces
    ``vllm.models.kimi_k3.amd.linear.KimiMoE`` (by a subclass of itself), the
    MoE that vLLM 0.33.0 and 0.34.0 build Kimi-K3 with on ROCm and on XPU
    (``vllm/models/kimi_k3/__init__.py`` exports ``amd.linear``'s
    ``KimiLinearForCausalLM`` there; the VL wrappers build the language model
    by that name, and the AMD MTP draft builds its decoder layer from
    ``amd.linear``). Nothing else in the module is touched.
Why
    Its ``KimiMoE.__init__`` pads ``moe_intermediate_size`` at model level to
    256 rows per tensor-parallel GPU whenever ``3072 // tp < 256`` (TP16,
    TP32), with no expert-parallel guard and ignoring data parallelism, then
    looks up ``self.experts.w13_weight_packed`` on the MoE runner
    (``ROCmLatentMoERunner``), which has no such attribute: every
    tensor-parallel size of 16 or more raises ``AttributeError``, with or
    without expert or data parallelism. Were the lookup guarded it would
    still allocate 256 rows at TP32 where the AITER MXFP4 kernel needs 128
    and emulation 96, 4096-row experts under expert parallelism where 3072
    are real, and record ``intermediate_size_per_partition_unpadded = 3072 //
    tp`` (wrong under EP or DP), which ROCm's AITER experts read to mask the
    pad rows.
How
    The same subclass layer as the NVIDIA patch
    (``vllm_kimi_k3_moe.models.kimi_k3.kimi_moe.BackendPaddedKimiMoE``): while
    upstream's ``__init__`` runs, ``padded_moe_intermediate_size`` reads as
    the logical size, so ``FusedMoEFactory`` gets 3072 and the padding block
    (the lookup that raises, the zeroing, the ``unpadded`` record) does not
    run. The per-GPU layout is chosen by the same chooser as on NVIDIA
    (``routed_experts``: vLLM's own method built on trial layouts, the
    backend's own rounding, e.g. emulation 32, AITER SiTU 128), which records
    the rows each GPU holds as ``intermediate_size_per_partition_unpadded``
    and zeroes the pads.
Related PR
    None for AMD yet: vLLM #50583 (the NVIDIA fix this plugin implements)
    leaves AMD out; #50928 (open) computes the model-level padding from the
    real shard count for both files, but keeps it at model level (256 rows
    at TP32) and does not touch the lookup that raises.
Delete when
    vLLM's AMD ``KimiMoE`` passes ``moe_intermediate_size`` to
    ``FusedMoEFactory`` (``in_vllm`` sees it and the plugin leaves this fix
    off); on any other vLLM code it checks ``TARGETS`` before patching
    (``vllm_kimi_k3_moe.verification``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``), on the CPU
    with ROCm's platform stood in (``tests/models/kimi_k3/amd``): CDNA3 and
    CDNA4, emulation and AITER, TP8 to TP32, with EP and DP; the emulation
    forward summed over every GPU of a split equals the unsharded experts.
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

KIMI_MOE_INIT = "vllm.models.kimi_k3.amd.linear:KimiMoE.__init__"
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
    """vLLM's own AMD ``KimiMoE`` hands its regular ``FusedMoEFactory``
    another size than the model-level padded one."""
    return factory_gets_logical_size(KIMI_MOE_INIT)
