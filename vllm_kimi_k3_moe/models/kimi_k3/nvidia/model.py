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
    (``patching.add_subclass_layer``) put in front of upstream ``KimiMoE``.
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
    ``vllm.models.kimi_k3.amd`` is never touched.
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

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.patching import add_subclass_layer, remove_subclass_layer
from vllm_kimi_k3_moe.verification.targets import keyword_arguments

KIMI_MOE_INIT = "vllm.models.kimi_k3.nvidia.model:KimiMoE.__init__"
# What the patch replaces or relies on (``vllm_kimi_k3_moe.verification``).
TARGETS = (KIMI_MOE_INIT,)
PADDED = "padded_moe_intermediate_size"


@dataclass
class KimiMoEBuild:
    """The ``KimiMoE`` under construction and its two sizes."""

    moe: Any
    logical_size: int  # config.moe_intermediate_size
    model_level_size: int | None = None  # upstream's padded_moe_intermediate_size
    # the plugin stepped aside while this layer was built (its fixes did not
    # hold on a small layer): the rest of it is built as vLLM alone builds it
    stepped_aside: bool = False


_current_build: contextvars.ContextVar[KimiMoEBuild | None] = contextvars.ContextVar(
    "kimi_k3_moe_current_build", default=None
)


def current_kimi_moe_build() -> KimiMoEBuild | None:
    """The Kimi-K3 ``KimiMoE`` being constructed in this context, if any."""
    return _current_build.get()


class BackendPaddedKimiMoE:
    """Put in front of upstream ``KimiMoE`` in the patched class's MRO."""

    def __init__(
        self, config: Any, vllm_config: Any, *args: Any, **kwargs: Any
    ) -> None:
        build = KimiMoEBuild(moe=self, logical_size=config.moe_intermediate_size)
        token = _current_build.set(build)
        try:
            super().__init__(config, vllm_config, *args, **kwargs)
        finally:
            _current_build.reset(token)
        self.__dict__["_model_level_moe_intermediate_size"] = build.model_level_size

    @property
    def padded_moe_intermediate_size(self) -> int | None:
        """Upstream's model-level size; the logical size while upstream's
        ``__init__`` hands it to the regular factory and its fixup guard."""
        build = _current_build.get()
        if build is not None and build.moe is self:
            if build.stepped_aside:
                return build.model_level_size
            return build.logical_size
        return self.__dict__.get("_model_level_moe_intermediate_size")

    @padded_moe_intermediate_size.setter
    def padded_moe_intermediate_size(self, value: int) -> None:
        build = _current_build.get()
        if build is not None and build.moe is self:
            build.model_level_size = value
        else:
            self.__dict__["_model_level_moe_intermediate_size"] = value


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    add_subclass_layer(upstream, "KimiMoE", BackendPaddedKimiMoE)


def revert(upstream: ModuleType) -> None:
    """Take the patch out of upstream's ``KimiMoE`` (idempotent)."""
    remove_subclass_layer(upstream, "KimiMoE", BackendPaddedKimiMoE)


def relied_on(find: Callable[[str], Any]) -> str | None:
    """Upstream ``KimiMoE.__init__`` sets and reads ``padded_moe_intermediate_size``
    (the attribute the patch answers as a property)."""
    if PADDED not in find(KIMI_MOE_INIT).__code__.co_names:
        return f"{KIMI_MOE_INIT} no longer uses {PADDED}"
    return None


def in_vllm(find: Callable[[str], Any]) -> str | None:
    """vLLM's own ``KimiMoE`` hands its regular ``FusedMoEFactory`` another
    size than the model-level padded one: the upstream fix."""
    given = keyword_arguments(KIMI_MOE_INIT, "FusedMoEFactory", "intermediate_size")
    if given and all(PADDED not in g for g in given):
        return f"KimiMoE gives FusedMoEFactory intermediate_size={given[0]}"
    return None
