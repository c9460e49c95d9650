"""vLLM general plugin: Kimi-K3 routed experts padded by their quantization backend.

Patch index, in the order the patches apply (each module opens with its full
ledger entry; each applies and reverts on its own):

``vllm_kimi_k3_moe.models.kimi_k3.nvidia.model``
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE``: regular (non-MegaMoE)
    FusedMoE receives ``moe_intermediate_size``; the selected quantization
    backend owns the padded per-rank layout. Delete with the vLLM release that
    ships the upstream fix.

``vllm_kimi_k3_moe.models.kimi_k3.amd.linear``
    ``vllm.models.kimi_k3.amd.linear.KimiMoE`` (Kimi-K3's MoE on ROCm and
    XPU): the same fix, where vLLM alone raises ``AttributeError`` at every
    tensor-parallel size of 16 or more. Delete with the vLLM release whose
    AMD ``KimiMoE`` hands the factory the logical size.

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
    loaded, before it quantizes. Each per-expert parameter's
    ``weight_loader`` zeroes a tensor vLLM materialised to reload into
    before its first write (``fresh_tensors``): pads stay zero through every
    in-place update. Delete with the model patch.

``vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading``
    ``KimiMoE`` of both models (NVIDIA's, AMD's): its routed-expert
    parameters' ``weight_loader`` refuses checkpoint tensors of the wrong
    shape or dtype and, at the cold start, duplicated and never-loaded expert
    tensors, in every format the registry knows; in-place updates are held
    to the shapes and dtypes only. Delete when vLLM's expert loader validates
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

``vllm_kimi_k3_moe.model_executor.model_loader.reload.layerwise``
    ``reload.layerwise.initialize_layerwise_reload``, wherever vLLM binds
    it: an update starts clean, whatever the one before it left open (put
    back as it was), and each Kimi-K3 layer starts a new record of what is
    sent to it. Delete when vLLM's reload rolls back unfinished updates.

``vllm_kimi_k3_moe.model_executor.model_loader.reload.direct`` (vLLM 0.34)
    ``reload.direct.begin_direct_reload``: the same new record in vLLM's
    direct mode. Delete with the strict expert loader.

``vllm_kimi_k3_moe.model_executor.model_loader.reload.plan`` (vLLM 0.34)
    ``reload.plan.plan_loads`` and ``LoadPlan.get_dest``: what a load plan
    writes without the loaders counts as sent; a plan declaring part of what
    a kernel keeps together is refused before anything is written. Delete
    with the strict expert loader.

``vllm_kimi_k3_moe.model_executor.models.utils``
    ``AutoWeightsLoader.load_weights``: an update of a Kimi-K3 model that
    fails midway, for any reason, leaves every layer it had not finished
    holding what it held. Delete when vLLM's reload rolls back a failed
    update.

``vllm_kimi_k3_moe.distributed.weight_transfer.base``
    ``WeightTransferEngine.update_weights`` (the NCCL, IPC and M2N engines
    inherit it): a receive that fails between two buckets does the same for
    the engine's target model. Delete with the patch above.

Every patch was verified against vLLM 0.33.0 and 0.34.0 (``compat``: the one
place the two releases differ for the plugin and its tools). Each declares
the upstream objects it touches (``TARGETS``); on any vLLM, before the first
patch goes on, ``verification`` judges every one of them: all that are
verified or checked go on (one line says so where the code or the version is
not a verified release's, or where other code replaced a target at run
time: then the first layer proves the fixes with it in place), those vLLM
already has stay off, and if any differs nothing is patched and one warning
names what. A wrapper of the plugin's that other code drops later steps the
plugin aside whole at the next Kimi-K3 layer (``fixes_in_effect``).

The offline tools (``vllm_kimi_k3_moe.tools``) are never imported by a
serving process; their temporary stand-ins for vLLM internals have their own
ledger in ``vllm_kimi_k3_moe.tools.meta_rank``.

``register()`` only installs import hooks: the patches apply when vLLM imports
a Kimi-K3 model module (NVIDIA's, or the AMD one on ROCm and XPU), in
whichever process does so; a process judges only the models it imports. ``unregister()``
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
from collections.abc import Iterable
from types import ModuleType

from vllm_kimi_k3_moe import patching
from vllm_kimi_k3_moe.compat import VERIFIED_VLLM_RELEASES, kimi_k3_platform_refusal
from vllm_kimi_k3_moe.import_hooks import call_after_import, remove_after_import
from vllm_kimi_k3_moe.verification import targets, verdict

__all__ = ["register", "unregister"]

# A child of vLLM's logger, so messages use vLLM's handler and format.
logger = logging.getLogger("vllm.plugins.kimi_k3_moe")

KIMI_K3_PACKAGE = "vllm.models.kimi_k3"
KIMI_K3_NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"
# Kimi-K3's MoE on ROCm and XPU (``vllm/models/kimi_k3/__init__.py``).
KIMI_K3_AMD_LINEAR = "vllm.models.kimi_k3.amd.linear"
ROUTED_EXPERTS = "vllm.model_executor.layers.fused_moe.routed_experts"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"
INT_WNA16_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.int_wna16"
MODEL_UTILS = "vllm.model_executor.models.utils"
WEIGHT_TRANSFER = "vllm.distributed.weight_transfer.base"
# vLLM's in-place updates, and where each module binds the function a patch
# wraps by name at import (every binding is wrapped: callers reach either)
RELOAD = "vllm.model_executor.model_loader.reload"
RELOAD_PATCHES = "vllm_kimi_k3_moe.model_executor.model_loader.reload"
UPDATE_START_SITES = tuple(
    f"{RELOAD}{site}"
    for site in ("", ".layerwise", ".inplace", ".lifecycle", ".torchao_decorator")
)
DIRECT_START_SITES = (f"{RELOAD}.direct", f"{RELOAD}.lifecycle")
LOAD_PLAN_SITES = (f"{RELOAD}.plan", RELOAD)
# The patch that chooses each layer's partition: its first layer built proves
# the fixes on a small layer where some fix goes on code it was not verified
# on (``fused_moe.proof.small_layer``).
PARTITION_PATCH = "vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts"
STRICT_LOADING = (
    "vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading"
)
# What the first layer owes, and settles (imported only where it is owed).
FIRST_LAYER = "vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof.first_layer"
# Each Kimi-K3 model module vLLM builds the MoE from, and its model patch: a
# process judges and patches only the models it imports (an NVIDIA process
# never imports the AMD model, nor a ROCm one the NVIDIA model).
MODEL_PATCHES = {
    KIMI_K3_NVIDIA_MODEL: "vllm_kimi_k3_moe.models.kimi_k3.nvidia.model",
    KIMI_K3_AMD_LINEAR: "vllm_kimi_k3_moe.models.kimi_k3.amd.linear",
}
# (vLLM module patched, plugin module with its apply / revert), in order.
PATCHES: tuple[tuple[str, str], ...] = (
    (KIMI_K3_NVIDIA_MODEL, MODEL_PATCHES[KIMI_K3_NVIDIA_MODEL]),
    (KIMI_K3_AMD_LINEAR, MODEL_PATCHES[KIMI_K3_AMD_LINEAR]),
    (ROUTED_EXPERTS, PARTITION_PATCH),
    (KIMI_K3_NVIDIA_MODEL, STRICT_LOADING),
    (KIMI_K3_AMD_LINEAR, STRICT_LOADING),
    (DEFAULT_LOADER, "vllm_kimi_k3_moe.model_executor.model_loader.default_loader"),
    (
        INT_WNA16_ORACLE,
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.oracle.int_wna16",
    ),
    *((site, f"{RELOAD_PATCHES}.layerwise") for site in UPDATE_START_SITES),
    *((site, f"{RELOAD_PATCHES}.direct") for site in DIRECT_START_SITES),
    *((site, f"{RELOAD_PATCHES}.plan") for site in LOAD_PLAN_SITES),
    (MODEL_UTILS, "vllm_kimi_k3_moe.model_executor.models.utils"),
    (WEIGHT_TRANSFER, "vllm_kimi_k3_moe.distributed.weight_transfer.base"),
)

_registered = False
_warned: set[str] = set()
_decided: list[tuple[str, ...]] = []  # this process's patches to apply, once
_judged_models: set[str] = set()  # the Kimi-K3 model modules judged with them


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


def patches_judged_with(models: Iterable[str]) -> list[str]:
    """The patch modules judged in a process that imported the Kimi-K3 model
    modules ``models``: every patch but the model patches of other models."""
    others = {patch for module, patch in MODEL_PATCHES.items() if module not in models}
    return [patch for _, patch in PATCHES if patch not in others]


def _verified_patches(model: str) -> tuple[str, ...]:
    """The patches to apply on this vLLM, judged before any is applied
    (``verification``), its one line logged; never raises. Judged once per
    process with the first Kimi-K3 model module imported (``model``), and
    again, all or nothing, when another one is (XPU imports both)."""
    if _decided and model in _judged_models:
        return _decided[0]
    first = not _decided
    _judged_models.add(model)
    try:
        from vllm.version import __version__

        verdicts = verdict.judge_all(patches_judged_with(_judged_models))
        plain = __version__ in VERIFIED_VLLM_RELEASES
        decision = verdict.decide(verdicts, __version__, plain, PARTITION_PATCH)
        apply, warning, line = decision.apply, decision.warning, decision.line
    except Exception as error:  # a difference must never stop vLLM
        apply, warning = (), True
        line = (
            "vllm-kimi-k3-moe: nothing patched, this vLLM could not be "
            f"checked ({type(error).__name__}: {error})".replace("\n", " ")
        )
    if not first:  # another model: its fix goes on too, or none at all
        if _decided[0] and not apply:
            _step_aside(line or "vllm-kimi-k3-moe: nothing patched")
        elif _decided[0]:
            _decided[0] = apply
            if decision.prove and line is not None:
                importlib.import_module(FIRST_LAYER).owe(decision, _step_aside)
        return _decided[0]
    if line is not None and warning:
        _warn_once(line)
    elif line is not None and decision.prove:  # said once proven
        importlib.import_module(FIRST_LAYER).owe(decision, _step_aside)
    elif line is not None:
        logger.info(line)
    _decided.append(apply)
    return _decided[0]


def _step_aside(line: str) -> None:
    """Nothing patched from now on: every applied patch reverted (layers
    built before keep what they were built with), no hook left to apply
    one, ``line`` said once."""
    _warn_once(line)
    applied = _decided[0] if _decided else ()
    _decided[:] = [()]
    for module_name, patch in reversed(PATCHES):
        remove_after_import(module_name, _APPLY[patch])
        module = sys.modules.get(module_name)
        if module is not None and patch in applied:
            sys.modules[patch].revert(module)


def fixes_in_effect() -> bool:
    """Whether every wrapper the plugin put on vLLM is still called (checked
    by each Kimi-K3 ``KimiMoE`` before it is built): other code that
    replaced one since, without calling on it, leaves half a fix, so the
    plugin steps aside whole, naming that code."""
    lost = patching.lost_wrappers()
    if not lost or not _decided or not _decided[0]:
        return not lost
    from vllm.version import __version__

    owner, name, holds = lost[0]
    _step_aside(
        f"vllm-kimi-k3-moe: nothing patched on vLLM {__version__} from now on: "
        f"{getattr(owner, '__qualname__', owner.__name__)}.{name} was replaced "
        f"after the plugin patched it, by {targets.name_of(holds)}, which does "
        "not call on what it replaced; the layers built from now on are vLLM "
        "alone's (README: Release policy)."
    )
    return False


def _patch_when_imported(model: ModuleType) -> None:
    """vLLM imported a Kimi-K3 model module (NVIDIA's, or AMD's on ROCm and
    XPU): judge its patches on this vLLM, then apply those that go on, each
    as soon as the module it patches is imported (the model module imports
    vLLM's fused MoE package and model loaders: these apply now). A model
    module not imported yet gets its patches when it is, judged then."""
    if _warned_platform_refusal():
        return
    apply = _verified_patches(model.__name__)
    for module, patch in PATCHES:
        if patch in apply and (module not in MODEL_PATCHES or module in _judged_models):
            call_after_import(module, _APPLY[patch])


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    # The package hook reports platforms that never import the NVIDIA model.
    call_after_import(KIMI_K3_PACKAGE, _warned_platform_refusal)
    for model in MODEL_PATCHES:
        call_after_import(model, _patch_when_imported)


def unregister() -> None:
    """Undo ``register``: remove the import hooks, revert every patch applied
    to an imported vLLM module, forget the warnings logged. Layers built
    before keep what they were built with."""
    global _registered
    remove_after_import(KIMI_K3_PACKAGE, _warned_platform_refusal)
    for model in MODEL_PATCHES:
        remove_after_import(model, _patch_when_imported)
    applied = _decided[0] if _decided else ()
    for module_name, patch_name in reversed(PATCHES):
        remove_after_import(module_name, _APPLY[patch_name])
        module = sys.modules.get(module_name)
        # only what went on: judging imports every patch module
        if module is not None and patch_name in applied:
            sys.modules[patch_name].revert(module)
    _warned.clear()
    _decided.clear()
    _judged_models.clear()
    first_layer = sys.modules.get(FIRST_LAYER)
    if first_layer is not None:
        first_layer.forgive()
    _registered = False
