"""Online quantization of Kimi-K3's routed experts: their pads zeroed once
loaded, before the method quantizes them.

Used by the ``routed_experts`` patch, for the method it installs inside a
``KimiMoE`` build. An online method (vLLM's ``OnlineMoEMethodBase``:
``--quantization fp8_per_block``, ``mxfp4``, ``fp8``/``fp8_per_tensor``,
``fp8_per_channel``, ``mxfp8``, ``int8_per_channel_weight_only``,
``experts_int8``, ``nvfp4_per_token``, vLLM 0.34's ``lut_b_moe``, or
``--quantization-config '{"moe": ...}'`` over a checkpoint that leaves its
experts unquantized) allocates the BF16 weights it will quantize on the
``meta`` device (``create_weights``). vLLM's layerwise loader materialises
them once the layer's checkpoint tensors have arrived (vLLM 0.33:
``torch.empty_strided``, whatever the memory held; 0.34 zeroes them), loads
the checkpoint rows, and calls the method's ``process_weights_after_loading``,
which quantizes every row, pads included. A zero fill at ``create_weights``
reaches nothing there (the tensors are on ``meta``), and the methods that zero
their pads themselves (``_zero_padding``: FP8 per block, MXFP4, LUT-B) zero
past the rows the layer records it holds, while the others (FP8 per tensor
and per channel, MXFP8, INT8, NVFP4) zero nothing: a pad read from reused
memory then enters a per-tensor, per-row or per-block maximum, or
dequantizes to what it held.

So the pads are zeroed at the start of the method's own
``process_weights_after_loading``, after the weights are materialised and
loaded and before anything reads them, with the method's own
``_zero_padding`` (past ``intermediate_size_per_partition_unpadded``, which
the ``routed_experts`` patch sets to the rows this GPU holds). Nothing else
of the method changes.

An online method's partition rule (``quantized_rule``) is learned from what
it quantizes to, not from what its ``create_weights`` allocates (the BF16 it
loads: one element per row whatever its blocks): its own
``process_weights_after_loading`` is run on a scratch layer of one expert at
two partitions, on the device the layer is built on, for one GPU (no
all-reduce of the scales), and stopped where it hands the quantized tensors
to its kernel (``_setup_kernel``, not run); every tensor whose extent follows
the rows says how many rows one of its scales (or packed elements) spans.
A GPU's partition must be whole such groups (its quantization starts at its
own first row: a BF16 checkpoint has no groups to keep whole across GPUs)
and what its kernel keeps once it prepared them (``kernel_rows.resident``,
with that group). Where the method cannot be run so (a checkpoint's quantized
experts re-quantized, ``requantization_source``; a quantizer the device
lacks; no ``_setup_kernel``: vLLM 0.34's LUT-B), no rule: vLLM alone's
partition.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from vllm_kimi_k3_moe.formats.record import PartitionRule

# Set by vLLM's online methods once they have quantized a layer (both
# releases): a later call (model_loader.utils' pass over every module after
# the layerwise loader already processed it) returns at once.
PROCESSED = "_already_called_process_weights_after_loading"


def is_online(method: Any) -> bool:
    """Whether ``method`` quantizes its BF16 weights while vLLM loads them."""
    from vllm.model_executor.layers.quantization.online.moe_base import (
        OnlineMoEMethodBase,
    )

    return isinstance(method, OnlineMoEMethodBase)


def pad_rows(config: Any) -> tuple[int, int]:
    """The first pad row of a ``FusedMoEConfig`` (the rows it records this
    GPU holds) and the rows it allocates."""
    return (
        config.intermediate_size_per_partition_unpadded,
        config.intermediate_size_per_partition,
    )


def zero_pads_before_quantizing(
    method: Any, zeroed: Callable[[Any], None] = lambda layer: None
) -> None:
    """Give the online ``method`` a ``process_weights_after_loading`` (an
    instance attribute, deferring to its own) that first zeroes the layer's
    pad rows, then calls ``zeroed(layer)``. Where the method re-quantizes a
    checkpoint's quantized experts (``requantization_source``), its source
    holds only the checkpoint rows and vLLM pads them with zeros itself
    (``get_weights_for_quantization``): nothing to zero."""
    own = method.process_weights_after_loading

    @functools.wraps(own)
    def process_weights_after_loading(layer: Any) -> None:
        if (
            not getattr(layer, PROCESSED, False)
            and method.requantization_source is None
            and not layer.w13_weight.is_meta
        ):
            held, allocated = pad_rows(layer.moe_config)
            if allocated > held:
                method._zero_padding(layer)
                zeroed(layer)
        own(layer)

    method.process_weights_after_loading = process_weights_after_loading


# The scratch layer's partitions and width: multiples of every block an
# online method quantizes in (FP8 128 x 128, MX 32, NVFP4 16).
SCRATCH_ROWS = (256, 512)
SCRATCH_WIDTH = 256
PREFIXES = ("w13", "w2")


class _Quantized(Exception):
    """Stops the scratch run where the method hands its quantized tensors to
    its kernel, carrying them."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        super().__init__("quantized")
        self.tensors = tensors


def _for_one_gpu(config: Any, rows: int, width: int) -> Any:
    """A copy of the layer's ``FusedMoEConfig`` for scratch experts of
    ``rows`` rows and ``width`` columns on one GPU (no scale all-reduce over
    the MoE group)."""
    scratch = copy.copy(config)
    scratch.moe_parallel_config = dataclasses.replace(
        config.moe_parallel_config, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0
    )
    scratch.intermediate_size_per_partition = rows
    scratch.intermediate_size_per_partition_unpadded = rows
    scratch.hidden_dim = scratch.hidden_dim_unpadded = width
    return scratch


def _handed_over(layer: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """The quantized tensors ``_setup_kernel`` was handed: its arguments
    (w13, w2, w13_scale, w2_scale: the FP8, MXFP4 and MXFP8 methods) or the
    layer's (INT8, NVFP4 quantize into it)."""
    import torch

    if len(args) >= 4:
        names = ("w13", "w2", "w13_scale", "w2_scale")
        return dict(zip(names, args[:4], strict=True))
    return {
        name: tensor
        for name, tensor in vars(layer).get("_parameters", {}).items()
        if name.startswith(PREFIXES) and isinstance(tensor, torch.Tensor)
    }


def quantized_tensors(
    method: Any, rows: int, width: int = SCRATCH_WIDTH, experts: int = 1
) -> dict[str, Any]:
    """What ``method`` quantizes ``experts`` experts of ``rows`` rows and
    ``width`` columns to: its own ``process_weights_after_loading`` on a
    scratch layer, on the default device, stopped at ``_setup_kernel``."""
    import torch
    from torch import nn

    scratch = copy.copy(method)  # the layer's method is left as it is
    scratch.moe = config = _for_one_gpu(method.moe, rows, width)

    def _setup_kernel(layer: Any, *args: Any, **kwargs: Any) -> None:
        raise _Quantized(_handed_over(layer, args))

    scratch._setup_kernel = _setup_kernel
    layer = nn.Module()
    layer.moe_config = config
    layer.num_experts = layer.local_num_experts = experts
    layer.global_num_experts = experts
    layer.orig_dtype = config.in_dtype
    layer.weight_block_size = None
    layer.w13_input_scale = layer.w2_input_scale = None
    layer.expert_map_manager = _NoSharedExperts()
    w13 = torch.ones(experts, config.w13_num_shards * rows, width)
    w2 = torch.ones(experts, width, rows)
    for name, weight in (("w13_weight", w13), ("w2_weight", w2)):
        layer.register_parameter(
            name, nn.Parameter(weight.to(config.in_dtype), requires_grad=False)
        )
    try:
        type(method).process_weights_after_loading(scratch, layer)
    except _Quantized as handed:
        return handed.tensors
    raise ValueError(f"{type(method).__name__} quantized without _setup_kernel")


class _NoSharedExperts:
    num_fused_shared_experts = 0


def _rows_per_element(name: str, small: Any, large: Any) -> int | None:
    """How many of the rows one element of a quantized tensor spans along
    them (1 where its extent does not follow the rows); None where its
    extent follows them but not in proportion (a padded scale layout)."""
    spanned = [rows * (2 if name.startswith("w13") else 1) for rows in SCRATCH_ROWS]
    spans = 1
    for a, b in zip(small.shape, large.shape, strict=True):
        if a == b:
            continue
        if b != 2 * a or spanned[0] % a:
            return None
        spans = math.lcm(spans, spanned[0] // a)
    return spans


def quantized_rule(method: Any) -> PartitionRule | None:
    """The partition rule of the online ``method``, from what it quantizes to
    (module docstring); None where that cannot be had."""
    if getattr(method, "requantization_source", None) is not None:
        return None
    try:
        small, large = (quantized_tensors(method, rows) for rows in SCRATCH_ROWS)
    except Exception:  # a quantizer this device lacks: no rule
        return None
    if not small or small.keys() != large.keys():
        return None
    group = 1
    for name, tensor in small.items():
        if not hasattr(tensor, "shape") or tensor.dim() != large[name].dim():
            return None
        spans = _rows_per_element(name, tensor, large[name])
        if spans is None:
            return None
        group = math.lcm(group, spans)
    return PartitionRule(
        f"learned from what {type(method).__name__} quantizes: "
        f"{group} rows per scale group",
        accepts=lambda method, hidden, n: n % group == 0,
        row_group=lambda method: group,
        groups_in_checkpoint=False,
    )
