"""vLLM general plugin: Kimi-K3 routed experts padded by their quantization backend.

Patch index (each module opens with its full ledger entry):

``vllm_kimi_k3_moe.models.kimi_k3.nvidia.model``
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE``: regular (non-MegaMoE)
    FusedMoE receives ``moe_intermediate_size``; the selected quantization
    backend owns the padded per-rank layout. Delete with the vLLM release that
    ships the upstream fix.

``vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts``
    ``RoutedExperts._get_quant_method``: inside a Kimi-K3 ``KimiMoE`` only,
    each quantization method allocates the smallest per-rank partition its
    kernel accepts (rules in ``partition_rules``), never more than vLLM
    alone, with a zero pad; a method without a rule keeps vLLM alone's
    partition. Delete with the model patch.

``vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading``
    Kimi-K3 routed-expert parameters' ``weight_loader``: refuses checkpoint
    tensors of the wrong shape, duplicated and never-loaded expert tensors,
    in every format whose layout it knows. Delete when vLLM's expert loader
    validates these itself.

``vllm_kimi_k3_moe.model_executor.model_loader.default_loader``
    ``DefaultModelLoader.get_all_weights``: remembers the checkpoint key of
    the tensor being loaded, so loading errors name it as the checkpoint
    does. Delete with the strict expert loader.

``register()`` only installs an import hook: the patches apply when vLLM imports
the Kimi-K3 NVIDIA model module, in whichever process does so. ``unregister()``
removes the hooks and reverts the patches.

Glossary (the code's names follow it):

projection
    One of a routed expert's three matrices: w1 (gate), w3 (up), w2 (down).
    vLLM fuses w1 and w3 into one ``w13_*`` parameter.
suffix
    What follows the projection in a checkpoint key: ``weight``,
    ``weight_packed``, ``weight_scale`` (and per-tensor scales).
shard
    One ``*.safetensors`` file of a checkpoint (never a projection).
rank
    One GPU of a deployment: TP x DP ranks, each holding a slice of every
    expert, or, with expert parallelism, whole experts.
partition
    The routed-expert intermediate rows one rank allocates: the logical slice
    (``moe_intermediate_size`` / TP) plus any pad its kernel needs.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType

from vllm_kimi_k3_moe.import_hooks import call_after_import, remove_after_import

__all__ = ["register", "unregister"]

# A child of vLLM's logger, so messages use vLLM's handler and format.
logger = logging.getLogger("vllm.plugins.kimi_k3_moe")

KIMI_K3_PACKAGE = "vllm.models.kimi_k3"
KIMI_K3_NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"
ROUTED_EXPERTS = "vllm.model_executor.layers.fused_moe.routed_experts"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
# vLLM module -> the plugin module that patches it (apply / revert).
PATCHES = {
    KIMI_K3_NVIDIA_MODEL: "vllm_kimi_k3_moe.models.kimi_k3.nvidia.model",
    ROUTED_EXPERTS: ("vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts"),
    DEFAULT_LOADER: "vllm_kimi_k3_moe.model_executor.model_loader.default_loader",
}

_registered = False
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _warned_platform_refusal(_module: ModuleType | None = None) -> bool:
    """Log why this platform is not patched, if it is not; say so."""
    from vllm_kimi_k3_moe.compat import kimi_k3_platform_refusal

    refusal = kimi_k3_platform_refusal()
    if refusal is not None:
        _warn_once(refusal)
    return refusal is not None


def _apply(module: ModuleType) -> None:
    importlib.import_module(PATCHES[module.__name__]).apply(module)


def _patch_nvidia_model(module: ModuleType) -> None:
    if _warned_platform_refusal():
        return
    _apply(module)
    # The model module imports vLLM's fused MoE package and model loaders:
    # these run now.
    call_after_import(ROUTED_EXPERTS, _apply)
    call_after_import(DEFAULT_LOADER, _apply)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True

    from vllm_kimi_k3_moe.compat import vllm_version_refusal

    refusal = vllm_version_refusal()
    if refusal is not None:
        _warn_once(refusal)
        return
    # The package hook reports platforms that never import the NVIDIA model.
    call_after_import(KIMI_K3_PACKAGE, _warned_platform_refusal)
    call_after_import(KIMI_K3_NVIDIA_MODEL, _patch_nvidia_model)


def unregister() -> None:
    """Undo ``register``: remove the import hooks, revert every patch applied
    to an imported vLLM module, forget the warnings logged. Layers built
    before keep what they were built with."""
    global _registered
    remove_after_import(KIMI_K3_PACKAGE, _warned_platform_refusal)
    remove_after_import(KIMI_K3_NVIDIA_MODEL, _patch_nvidia_model)
    remove_after_import(ROUTED_EXPERTS, _apply)
    remove_after_import(DEFAULT_LOADER, _apply)
    for module_name, patch_name in PATCHES.items():
        module = sys.modules.get(module_name)
        if module is not None and patch_name in sys.modules:
            sys.modules[patch_name].revert(module)
    _warned.clear()
    _registered = False
