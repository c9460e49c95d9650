"""Kimi-K3 NVIDIA: regular FusedMoE gets the logical MoE size; the backend pads it.

Patch ledger entry
------------------
Replaces
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE`` (by a subclass of itself) and
    that module's ``FusedMoEFactory`` global (by a pass-through that acts only
    while a ``KimiMoE`` is being built). Nothing else in vLLM is touched.
Why
    vLLM 0.33.0 pads ``moe_intermediate_size`` at model level to
    ``min_moe_intermediate_per_partition`` (256) per TP rank and hands that to
    the regular FusedMoE path. At TP32 the logical slice is 3072 / 32 = 96 and
    the MXFP4 Marlin kernel needs 128, but the layer allocates 256: routed
    experts take ~120.5 GB per GPU instead of ~60.3 GB and Kimi-K3 does not
    load on 96 GB GPUs.
How
    While the subclass runs upstream ``KimiMoE.__init__``, the factory
    pass-through swaps the model-level padded size for
    ``config.moe_intermediate_size``; the quantization method's
    ``maybe_roundup_sizes`` then pads the per-rank partition to what its kernel
    needs (Marlin: 96 -> 128) and its ``create_weights`` zero-fills the tail.
    Upstream's post-construction block (zeroing ``w13``/``w2`` and assigning
    ``intermediate_size_per_partition_unpadded``) is guarded by
    ``padded_moe_intermediate_size != moe_intermediate_size``; the pass-through
    shows it the logical size so it does not run, and the subclass restores the
    model-level value afterwards. ``padded_moe_intermediate_size`` therefore
    keeps upstream's value and MegaMoE (``DeepGemmMegaMoEExperts``) stays its
    only consumer. Expert parallelism (no model-level padding) and TP sizes
    where the model-level minimum is not hit reach the factory with the logical
    size already and pass through untouched. ``vllm.models.kimi_k3.amd`` is
    never touched.
Related PR
    vLLM "[Bugfix][Model] Kimi-K3 NVIDIA: delegate regular FusedMoE padding to
    the selected quantization backend" (builds on #51131, overlaps #50928).
Delete when
    vLLM ships that PR: the first release whose NVIDIA ``KimiMoE`` passes
    ``moe_intermediate_size`` to ``FusedMoEFactory``. Until then the plugin
    refuses any vLLM other than 0.33.x (see ``vllm_kimi_k3_moe.compat``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass
class _KimiMoEBuild:
    """The ``KimiMoE`` under construction and its sizes."""

    moe: Any
    logical_size: int
    model_level_size: int | None = None


_current_build: contextvars.ContextVar[_KimiMoEBuild | None] = contextvars.ContextVar(
    "kimi_k3_moe_current_build", default=None
)


def building_kimi_moe() -> bool:
    """Whether a Kimi-K3 ``KimiMoE`` is being constructed in this context."""
    return _current_build.get() is not None


class BackendPaddedKimiMoE:
    """Placed in front of upstream ``KimiMoE`` in the patched class's MRO."""

    def __init__(
        self, config: Any, vllm_config: Any, *args: Any, **kwargs: Any
    ) -> None:
        build = _KimiMoEBuild(moe=self, logical_size=config.moe_intermediate_size)
        token = _current_build.set(build)
        try:
            super().__init__(config, vllm_config, *args, **kwargs)
        finally:
            _current_build.reset(token)
        if build.model_level_size is not None:
            self.padded_moe_intermediate_size = build.model_level_size
        from vllm_kimi_k3_moe.model_executor.layers.fused_moe import routed_experts

        routed_experts.make_expert_loading_strict(self, config.moe_intermediate_size)


def factory_receiving_logical_size(
    fused_moe_factory: Callable[..., Any],
) -> Callable[..., Any]:
    """Wrap ``FusedMoEFactory`` as the Kimi-K3 NVIDIA module sees it."""

    @functools.wraps(fused_moe_factory)
    def factory(*args: Any, **kwargs: Any) -> Any:
        build = _current_build.get()
        if build is None or build.model_level_size is not None:
            return fused_moe_factory(*args, **kwargs)
        requested = kwargs.get("intermediate_size")
        if requested == build.logical_size:
            # No model-level padding at this topology (or upstream is fixed).
            return fused_moe_factory(*args, **kwargs)
        model_level = build.moe.padded_moe_intermediate_size
        if requested != model_level:
            raise RuntimeError(
                "vllm-kimi-k3-moe: KimiMoE passed intermediate_size="
                f"{requested!r} to FusedMoEFactory, neither the logical "
                f"moe_intermediate_size={build.logical_size} nor "
                f"padded_moe_intermediate_size={model_level}; this vLLM is not "
                "the 0.33.0 the patch was written for."
            )
        build.model_level_size = model_level
        # Upstream's zeroing/fixup block runs only when these two differ.
        build.moe.padded_moe_intermediate_size = build.logical_size
        kwargs["intermediate_size"] = build.logical_size
        return fused_moe_factory(*args, **kwargs)

    return factory


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    if issubclass(upstream.KimiMoE, BackendPaddedKimiMoE):
        return
    upstream.FusedMoEFactory = factory_receiving_logical_size(upstream.FusedMoEFactory)
    upstream.KimiMoE = type(
        "KimiMoE",
        (BackendPaddedKimiMoE, upstream.KimiMoE),
        {
            "__module__": upstream.__name__,
            "__qualname__": "KimiMoE",
            "__doc__": "Upstream KimiMoE; regular experts get the logical size "
            "(patched by vllm-kimi-k3-moe).",
        },
    )


def upstream_kimi_moe(upstream: ModuleType) -> type:
    """The unpatched ``KimiMoE`` class, whether or not ``apply`` has run."""
    for cls in upstream.KimiMoE.__mro__:
        if not issubclass(cls, BackendPaddedKimiMoE):
            return cls
    raise AssertionError("unreachable: object is in every MRO")
