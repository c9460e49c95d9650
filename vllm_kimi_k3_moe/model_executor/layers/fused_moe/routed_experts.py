"""Kimi-K3 routed experts: each quantization method is built for its kernel's
smallest per-GPU partition, never more than vLLM alone allocates, with zero
pads (zeroed once loaded, for a method quantizing while vLLM loads), the rows
each GPU holds recorded, and whole scale groups on every GPU.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.
    _get_quant_method`` (class attribute; a wrapper that calls it). Only while
    a Kimi-K3 ``KimiMoE`` is being built (NVIDIA or AMD; main model and MTP draft)
    does the wrapper act: it chooses the layer's per-GPU layout (the
    ``FusedMoEConfig`` partition fields), builds the quantization method for
    it, and sets two instance attributes on that method,
    ``maybe_roundup_sizes`` and ``create_weights``, which defer to the
    method's own, and wraps the ``weight_loader`` attribute of each
    per-expert parameter (``fresh_tensors``) (for an online method a third,
    ``process_weights_after_loading``: ``online``; and, where a GPU holds
    whole INT scale groups, one on the layer:
    ``_load_model_weight_or_group_weight_scale``). Every other model's
    layers, and these methods outside the build, behave as upstream.
Why
    With the model-level padding gone (``vllm_kimi_k3_moe.models.kimi_k3.
    nvidia.model``) each method would get the logical per-GPU slice (96 at
    TP32; also 96 at TP8 x DP4, where vLLM shards every expert over all 32
    GPUs and never pads). Only some methods own their padding: the FP8
    block method refuses 96 and 192 (``create_weights``: not divisible by
    ``block_n`` 128), the compressed-tensors MXFP4 method hands Marlin a 96
    it cannot run, and the WNA16 methods (compressed-tensors, AutoAWQ,
    AutoGPTQ) check Marlin against the partition while they are constructed
    (``select_wna16_moe_backend``), where groups of 64 or 128 do not divide
    96 or 192: they raise, or fall back to another kernel. Where the slice
    splits a scale group, a GPU would load another GPU's scales. And vLLM
    alone's pads are uninitialised memory for the methods that allocate with
    ``torch.empty``: the kernel multiplies through them. The online methods
    (a BF16 checkpoint with ``--quantization fp8_per_block``, ``mxfp4``,
    ``fp8_per_tensor``, ``fp8_per_channel``, ``mxfp8``, ``int8...``,
    ``nvfp4_per_token``, or ``--quantization-config '{"moe": ...}'``)
    allocate on ``meta`` and quantize once vLLM's layerwise loader has
    materialised and loaded the weights: on vLLM 0.33 the pads are then
    whatever the memory held, zeroed only by the methods with
    ``_zero_padding`` (FP8 per block, MXFP4) and only past the rows the
    layer records it holds, which vLLM alone's ``KimiMoE`` sets to
    ``moe_intermediate_size`` / TP after construction (192 at TP16 x DP2,
    where a GPU holds 96 of a 128-row allocation), and which the layout kept
    as vLLM alone's would leave at the allocation (nothing zeroed). A pad
    read from reused memory enters a per-tensor, per-row or per-block
    maximum (FP8 per block at TP16: every real row off by 0.58) or
    dequantizes to what it held.
How
    ``partition.LayoutChooser`` first builds the method as vLLM alone would
    (for the model-level size it would have been handed), then searches,
    with the method's format rule (``vllm_kimi_k3_moe.formats``: each calls
    the vLLM check that enforces it) or, for a method no format names, a
    rule learned from its own ``create_weights`` (``learned_rule``), the
    smallest partition the kernel accepts and keeps as it is when it
    prepares its weights (``kernel_rows``), never above what vLLM
    alone's kernel keeps where vLLM alone's runs, with whole scale groups per
    GPU where the even slice splits one (vLLM's block-aligned loader,
    ``tp_shard_with_padding``), and builds the method for it; it must select
    vLLM alone's kernel, or vLLM alone's layout is kept exactly. The layout
    is the one the method's constructor leaves (native FP8 pads to whole
    blocks itself). A method without any rule keeps vLLM alone's layout.
    Where vLLM alone fails and no partition builds, vLLM alone's error is
    raised. An online method's rule is learned from what it quantizes to
    (``online.quantized_rule``; its ``create_weights`` allocates the BF16 it
    loads), never above what vLLM alone allocates. Then
    ``maybe_roundup_sizes`` answers the chosen partition, ``create_weights``
    records in the layer's ``FusedMoEConfig`` the rows the GPU holds (its
    even slice of the checkpoint, where it does not hold whole groups:
    ``intermediate_size_per_partition_unpadded``, as vLLM alone's
    ``KimiMoE`` does after construction, over TP x DP) and zero-fills the
    per-expert tensors before any weight is loaded (the loader writes only
    checkpoint rows), has each per-expert parameter's loader zero a tensor
    vLLM materialised for an in-place update before its first write
    (``fresh_tensors``: vLLM 0.33's layerwise reload leaves it as the memory
    held), or, for an online method, gives it a
    ``process_weights_after_loading`` that zeroes the pad rows with the
    method's own ``_zero_padding`` once the weights are materialised and
    loaded, before the method quantizes them (``online``); a whole-group INT
    layer's pads keep scale 0 (vLLM's loader would give them 1; an INT zero
    code is not zero). Each process logs one line per method, backend and
    partition (it claims no zeroing), and one when an online layer's pads
    were zeroed. On vLLM code the plugin was not verified on, the first
    layer settles the proof the registration left owed before anything
    else (``proof.first_layer``: its small copies, built by this
    same wrapper, on every GPU of its split); where it does not hold, the
    plugin has stepped aside and this layer is built as vLLM alone builds it
    (``LayoutChooser.as_vllm_alone``, ``KimiMoEBuild.stepped_aside``).
Related PR
    The same vLLM PR as the model patch: "Kimi-K3 NVIDIA: delegate regular
    FusedMoE padding to the selected quantization backend" (its backends must
    own their padding; in 0.33.0 and 0.34.0 not all do), #50928 (padding
    from the real shard count, TP x DP x PCP: "TP8 x DP4, no EP: real shards
    32"), and vLLM 0.34's zeroing of tensors the layerwise loader
    materialises (``reload/meta.py``; not in 0.33).
Delete when
    Together with the model patch, once every method Kimi-K3 is published for
    pads for its own kernel, for the layer's real shard count, in the vLLM
    release that ships that PR (``in_vllm`` detects it, with the model
    patch's check: the plugin then leaves this fix off); the online part
    needs that release's ``KimiMoE`` to record the rows over TP x DP and its
    layerwise loader to zero what it materialises (0.34's does; so does the
    zeroing of tensors materialised for an in-place update,
    ``fresh_tensors``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each (the online paths:
    ``tests/models/kimi_k3/preparation/test_online_quantization.py``). On
    0.34 the online zeroing finds the pads zero already at a cold start.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.fresh_tensors import (
    expert_parameters,
    zero_fresh_tensors_before_loading,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import (
    is_online,
    pad_rows,
    zero_pads_before_quantizing,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import (
    Chosen,
    LayoutChooser,
    PartitionChoice,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import first_layer
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.said_once import say_once
from vllm_kimi_k3_moe.models.kimi_k3.amd import linear as amd_linear
from vllm_kimi_k3_moe.models.kimi_k3.kimi_moe import (
    KimiMoEBuild,
    current_kimi_moe_build,
    factory_gets_logical_size,
)
from vllm_kimi_k3_moe.models.kimi_k3.nvidia import model as nvidia_model
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

__all__ = ["PartitionChoice", "apply", "revert", "zero_expert_tensors"]

_ROUTED_EXPERTS = "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts"
# What the patch replaces or relies on (``vllm_kimi_k3_moe.verification``):
# upstream's __init__ builds the method with _get_quant_method, then asks it
# maybe_roundup_sizes and create_weights (the two the patch answers); and,
# for ``fresh_tensors``, how vLLM's reload copies a parameter to ``meta`` and
# materialises it (carrying its attributes: its weight_loader).
_RELOAD_META = "vllm.model_executor.model_loader.reload.meta"
TARGETS = (
    f"{_ROUTED_EXPERTS}.__init__",
    f"{_ROUTED_EXPERTS}._get_quant_method",
    f"{_RELOAD_META}:to_meta_tensor",
    f"{_RELOAD_META}:materialize_meta_tensor",
)
_CALLED_BY_INIT = ("_get_quant_method", "maybe_roundup_sizes", "create_weights")


def zero_expert_tensors(layer: torch.nn.Module) -> None:
    """Zero every per-expert weight and scale tensor (``[experts, rows, cols]``
    ``w13_*`` / ``w2_*``) of ``layer``: the loader fills the checkpoint rows
    of each, the pad stays zero (weights and scales, so it dequantizes to
    zero in every format, INT4's offset nibbles included)."""
    for param in expert_parameters(layer).values():
        param.data.zero_()


def _pads_keep_zero_scales(layer: torch.nn.Module) -> None:
    """vLLM's block-aligned loader fills the part of a GPU's group tensors
    past the checkpoint with 1 for scales and zero points (FP8's identity):
    here it fills them with 0, so an INT pad dequantizes to zero."""
    own = layer._load_model_weight_or_group_weight_scale

    @functools.wraps(own)
    def load(*args: Any, is_scale: bool = False, **kwargs: Any) -> None:
        own(*args, **kwargs)

    layer._load_model_weight_or_group_weight_scale = load


def _install(method: Any, build: KimiMoEBuild, chosen: Chosen) -> None:
    """Give ``method`` the chosen sizing for the layer being built."""
    own_round_up = method.maybe_roundup_sizes
    own_create_weights = method.create_weights
    choice = chosen.choice

    @functools.wraps(own_round_up)
    def maybe_roundup_sizes(
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: Any,
    ) -> tuple[int, int]:
        hidden, n = own_round_up(
            hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config
        )
        if current_kimi_moe_build() is not build:
            return hidden, n
        say_once(choice.log_line())
        return hidden, choice.allocated

    @functools.wraps(own_create_weights)
    def create_weights(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        own_create_weights(layer, *args, **kwargs)
        if current_kimi_moe_build() is not build:
            return
        layer.kimi_k3_partition = choice  # what the tools report of it
        zero_fresh_tensors_before_loading(layer)  # in-place updates' tensors
        if not chosen.layout.whole_groups:
            record_rows_held(layer.moe_config, choice.logical)
        if is_online(method):  # on meta until loaded: zeroed before quantizing
            zero_pads_before_quantizing(method, functools.partial(_log_zeroed, choice))
        elif choice.allocated != choice.logical or chosen.layout.whole_groups:
            zero_expert_tensors(layer)
        if chosen.layout.whole_groups and chosen.zero_pad_scales:
            _pads_keep_zero_scales(layer)

    method.maybe_roundup_sizes = maybe_roundup_sizes
    method.create_weights = create_weights


def record_rows_held(config: Any, logical: int) -> None:
    """Record in the layer's ``FusedMoEConfig`` the checkpoint rows of every
    expert this GPU holds (its even slice, ``logical``: what vLLM's loader
    writes), as vLLM alone's ``KimiMoE`` does after construction where it
    padded the partition. vLLM alone records ``moe_intermediate_size`` / TP
    there, which is more than the GPU holds under data parallelism (TP16 x
    DP2: 192 of a 128-row allocation; each GPU holds 96); kept as built, the
    chooser's record of vLLM alone's partition would say every allocated row
    is held. Who reads it: the online methods' ``_zero_padding`` (zeroes past
    it), the unquantized method's pad zeroing, vLLM 0.34's
    ``padding_fill_params`` (what a direct-mode reload zero-fills)."""
    config.intermediate_size_per_partition_unpadded = min(
        logical, config.intermediate_size_per_partition
    )


def _log_zeroed(choice: PartitionChoice, layer: torch.nn.Module) -> None:
    """Say once per process what an online method's pad zeroing did."""
    held, allocated = pad_rows(layer.moe_config)
    line = (
        f"vllm-kimi-k3-moe: Kimi-K3 routed experts on {choice.method} "
        f"({choice.backend}): zeroed pad rows {held}-{allocated - 1} of every "
        "expert (gate, up and down) once loaded, before the method quantized them"
    )
    say_once(line)


def _kimi_k3_get_quant_method(own: Callable) -> Callable:
    @functools.wraps(own)
    def _get_quant_method(
        self: Any, prefix: str, quant_config: Any, moe_config: Any
    ) -> Any:
        build = current_kimi_moe_build()
        if build is None:
            return own(self, prefix, quant_config, moe_config)
        chooser = LayoutChooser(
            moe_config, build, lambda: own(self, prefix, quant_config, moe_config)
        )
        if _not_proven(self, build):  # stepped aside: vLLM alone's layer
            build.stepped_aside = True
            return chooser.as_vllm_alone()
        chosen = chooser.choose()
        chosen.layout.set_on(moe_config)
        _install(chosen.method, build, chosen)
        return chosen.method

    return _get_quant_method


def _not_proven(experts: Any, build: KimiMoEBuild) -> bool:
    """On code the fixes were not verified on, the first layer built proves
    them on a small copy of itself first (``proof.first_layer``);
    True where that failed (the plugin has stepped aside)."""
    if not first_layer.owed():
        return False
    with torch.device(_device_for_proof()):
        return not first_layer.settle(experts, build.logical_size)


def _device_for_proof() -> torch.device:
    """Where the layer is built (a GPU, when serving), or the CPU where that
    is ``meta`` (the tools' real-size builds: a proof must read values)."""
    device = torch.get_default_device()
    return torch.device("cpu") if device.type == "meta" else device


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    wrap_method(upstream.RoutedExperts, "_get_quant_method", _kimi_k3_get_quant_method)


def revert(upstream: ModuleType) -> None:
    """Put upstream's own ``_get_quant_method`` back (idempotent)."""
    unwrap_method(upstream.RoutedExperts, "_get_quant_method")


def relied_on(find: Callable[[str], Any]) -> str | None:
    """Upstream ``RoutedExperts.__init__`` still calls what the patch answers."""
    used = find(TARGETS[0]).__code__.co_names
    missing = [name for name in _CALLED_BY_INIT if name not in used]
    if missing:
        return f"{TARGETS[0]} no longer calls {', '.join(missing)}"
    return None


def in_vllm(find: Callable[[str], Any]) -> str | None:
    """With vLLM's own ``KimiMoE`` giving the logical size, each method pads
    for its kernel in vLLM itself: the partition is vLLM's (the same PR).
    Asked of each Kimi-K3 model this process imported (the NVIDIA model, the
    AMD one on ROCm and XPU; importing the other is not this check's to do)."""
    inits = [
        init
        for init in (nvidia_model.KIMI_MOE_INIT, amd_linear.KIMI_MOE_INIT)
        if init.partition(":")[0] in sys.modules
    ]
    fixed = [factory_gets_logical_size(init) for init in inits]
    if fixed and all(fixed):
        return fixed[0]
    return None
