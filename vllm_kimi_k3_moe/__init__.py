"""vLLM general plugin: Kimi-K3 routed experts padded by their quantization backend.

Patch index, in the order the patches apply (each module opens with its full
ledger entry; each applies and reverts on its own):

``vllm_kimi_k3_moe.models.kimi_k3.nvidia.model``
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE``: regular (non-MegaMoE)
    FusedMoE receives ``moe_intermediate_size``; the selected quantization
    backend owns the padded per-rank layout. Delete with the vLLM release that
    ships the upstream fix.

``vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts``
    ``RoutedExperts._get_quant_method``: inside a Kimi-K3 ``KimiMoE`` only,
    the layer's per-GPU layout is chosen before its quantization method is
    built (``partition``), for the real TP x DP split: the smallest
    partition the method's kernel accepts and keeps after its weight
    preparation (its format's rule in ``vllm_kimi_k3_moe.formats``, or one
    learned from the method), never more than vLLM alone's kernel keeps, on
    vLLM alone's kernel, whole scale groups per GPU where the even slice
    splits one, with a zero pad and the rows each GPU holds recorded; a
    method without any rule keeps vLLM alone's partition, and so does an
    online method (quantizing BF16 while vLLM loads it), its pads zeroed once
    loaded, before it quantizes. Delete with the model patch.

``vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading``
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE``: its routed-expert
    parameters' ``weight_loader`` refuses checkpoint tensors of the wrong
    shape or dtype, duplicated and never-loaded expert tensors, in every
    format the registry knows. Delete when vLLM's expert loader validates
    these itself (independent of the padding patches).

``vllm_kimi_k3_moe.model_executor.model_loader.default_loader``
    ``DefaultModelLoader.get_all_weights``: remembers the checkpoint key of
    the tensor being loaded, so loading errors name it as the checkpoint
    does. Delete with the strict expert loader.

``vllm_kimi_k3_moe.model_executor.layers.fused_moe.oracle.int_wna16``
    ``oracle.int_wna16._process_weights_marlin`` and
    ``_process_awq_weights_marlin``: for Kimi-K3 routed experts, Marlin's
    integer weight preparation permutes w13's scales for the expert width
    (the K the kernel divides by the scale rows). Delete with the model
    patch.

Every patch was verified against vLLM 0.33.0 and 0.34.0 (``compat``: the one
place the two releases differ for the plugin and its tools).

The offline tools (``vllm_kimi_k3_moe.tools``) are never imported by a
serving process; their temporary stand-ins for vLLM internals have their own
ledger in ``vllm_kimi_k3_moe.tools.meta_rank``.

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

from vllm_kimi_k3_moe.compat import kimi_k3_platform_refusal, vllm_version_refusal
from vllm_kimi_k3_moe.import_hooks import call_after_import, remove_after_import

__all__ = ["register", "unregister"]

# A child of vLLM's logger, so messages use vLLM's handler and format.
logger = logging.getLogger("vllm.plugins.kimi_k3_moe")

KIMI_K3_PACKAGE = "vllm.models.kimi_k3"
KIMI_K3_NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"
ROUTED_EXPERTS = "vllm.model_executor.layers.fused_moe.routed_experts"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
INT_WNA16_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.int_wna16"
# (vLLM module patched, plugin module with its apply / revert), in order.
PATCHES: tuple[tuple[str, str], ...] = (
    (KIMI_K3_NVIDIA_MODEL, "vllm_kimi_k3_moe.models.kimi_k3.nvidia.model"),
    (ROUTED_EXPERTS, "vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts"),
    (
        KIMI_K3_NVIDIA_MODEL,
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading",
    ),
    (DEFAULT_LOADER, "vllm_kimi_k3_moe.model_executor.model_loader.default_loader"),
    (
        INT_WNA16_ORACLE,
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.oracle.int_wna16",
    ),
)

_registered = False
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _warned_platform_refusal(_module: ModuleType | None = None) -> bool:
    """Log why this platform is not patched, if it is not; say so."""
    refusal = kimi_k3_platform_refusal()
    if refusal is not None:
        _warn_once(refusal)
    return refusal is not None


class _ApplyPatch:
    """The import hook that applies one patch module to its vLLM module."""

    def __init__(self, patch: str) -> None:
        self.patch = patch

    def __call__(self, module: ModuleType) -> None:
        importlib.import_module(self.patch).apply(module)


_APPLY = {patch: _ApplyPatch(patch) for _, patch in PATCHES}


def _patch_when_imported(_nvidia_model: ModuleType) -> None:
    """vLLM imported its Kimi-K3 NVIDIA model: apply every patch, each as
    soon as the module it patches is imported (the model module imports
    vLLM's fused MoE package and model loaders: these apply now)."""
    if _warned_platform_refusal():
        return
    for module, patch in PATCHES:
        call_after_import(module, _APPLY[patch])


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True

    refusal = vllm_version_refusal()
    if refusal is not None:
        _warn_once(refusal)
        return
    # The package hook reports platforms that never import the NVIDIA model.
    call_after_import(KIMI_K3_PACKAGE, _warned_platform_refusal)
    call_after_import(KIMI_K3_NVIDIA_MODEL, _patch_when_imported)


def unregister() -> None:
    """Undo ``register``: remove the import hooks, revert every patch applied
    to an imported vLLM module, forget the warnings logged. Layers built
    before keep what they were built with."""
    global _registered
    remove_after_import(KIMI_K3_PACKAGE, _warned_platform_refusal)
    remove_after_import(KIMI_K3_NVIDIA_MODEL, _patch_when_imported)
    for module_name, patch_name in reversed(PATCHES):
        remove_after_import(module_name, _APPLY[patch_name])
        module = sys.modules.get(module_name)
        if module is not None and patch_name in sys.modules:
            sys.modules[patch_name].revert(module)
    _warned.clear()
    _registered = False
