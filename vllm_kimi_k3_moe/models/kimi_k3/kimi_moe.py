"""What both Kimi-K3 model patches share: the ``KimiMoE`` under construction
and the subclass layer that hands vLLM's regular ``FusedMoEFactory`` the
logical MoE size.

vLLM builds Kimi-K3's MoE from one of two files, by platform
(``vllm/models/kimi_k3/__init__.py``): ``nvidia/model.py`` on CUDA,
``amd/linear.py`` on ROCm and XPU. Both ``KimiMoE.__init__`` assign
``padded_moe_intermediate_size`` (the model-level padding: 256 rows per
tensor-parallel GPU), hand it to ``FusedMoEFactory`` as
``intermediate_size`` and compare it with ``moe_intermediate_size`` to guard a
post-construction block. The layer here answers that attribute with the
logical size while upstream's ``__init__`` runs, so the factory gets 3072
and the block does not run; the layout each GPU allocates is then chosen by
``vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts`` from the
build recorded here. Each model patch (``nvidia/model.py``, ``amd/linear.py``
in this package) puts the layer on its module's ``KimiMoE``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.verification.targets import keyword_arguments

PADDED = "padded_moe_intermediate_size"


@dataclass
class KimiMoEBuild:
    """The ``KimiMoE`` under construction and its two sizes."""

    moe: Any
    logical_size: int  # config.moe_intermediate_size
    model_level_size: int | None = None  # upstream's padded_moe_intermediate_size
    # the plugin stepped aside before or while this layer was built (its
    # fixes did not hold on a small layer, or other code replaced one of its
    # wrappers since): the rest of it is built as vLLM alone builds it
    stepped_aside: bool = False


_current_build: contextvars.ContextVar[KimiMoEBuild | None] = contextvars.ContextVar(
    "kimi_k3_moe_current_build", default=None
)


def current_kimi_moe_build() -> KimiMoEBuild | None:
    """The Kimi-K3 ``KimiMoE`` being constructed in this context, if any."""
    return _current_build.get()


class BackendPaddedKimiMoE:
    """Put in front of upstream ``KimiMoE`` in the patched class's MRO. Both
    upstream classes take the text config first (NVIDIA: ``(config,
    vllm_config, ...)``; AMD: ``(config, quant_config, prefix, layer_idx)``,
    by keyword from its decoder layer): everything is passed on as given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs["config"] if "config" in kwargs else args[0]
        build = KimiMoEBuild(moe=self, logical_size=config.moe_intermediate_size)
        # the plugin's other wrappers still called, or it steps aside whole
        build.stepped_aside = not vllm_kimi_k3_moe.fixes_in_effect()
        token = _current_build.set(build)
        try:
            super().__init__(*args, **kwargs)
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


def uses_padded_size(init: str, find: Callable[[str], Any]) -> str | None:
    """``relied_on`` of a model patch: upstream ``KimiMoE.__init__`` (the
    target ``init``) sets and reads ``padded_moe_intermediate_size``."""
    if PADDED not in find(init).__code__.co_names:
        return f"{init} no longer uses {PADDED}"
    return None


def factory_gets_logical_size(init: str) -> str | None:
    """``in_vllm`` of a model patch: vLLM's own ``KimiMoE.__init__`` (the
    target ``init``) hands its regular ``FusedMoEFactory`` another size than
    the model-level padded one: the upstream fix."""
    given = keyword_arguments(init, "FusedMoEFactory", "intermediate_size")
    if given and all(PADDED not in g for g in given):
        return f"KimiMoE gives FusedMoEFactory intermediate_size={given[0]}"
    return None
