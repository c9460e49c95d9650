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
of the method changes. An online method has no partition rule
(``learned_rule`` refuses it): what its ``create_weights`` allocates is the
BF16 it loads, not what it quantizes to or what its kernel keeps, so it keeps
vLLM alone's partition.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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
