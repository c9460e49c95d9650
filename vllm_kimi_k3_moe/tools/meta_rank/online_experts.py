"""What a rank's routed experts keep when a BF16 checkpoint is quantized while
vLLM loads it (``vllm serve --quantization fp8_per_block``, ...): the
quantized tensors, not the BF16 the method allocates.

An online method's ``create_weights`` allocates the BF16 weights it loads (on
``meta`` until then); its ``process_weights_after_loading`` quantizes them
and hands the quantized values and scales to its kernel (``_setup_kernel``),
and the BF16 is freed. So a build on ``meta`` shows the BF16, never what the
GPU keeps. Here the method's own ``process_weights_after_loading`` is run on
``meta`` for the layer's shapes (its local experts, the partition the layer
was built with, its width), stopped where it hands its kernel the quantized
tensors, exactly as the plugin learns the method's partition rule
(``online.quantized_tensors``); their bytes are what the rank keeps of its
routed experts. The kernel's own preparation (a Marlin repack, a swizzle) is
not run: it rearranges those tensors into its layout, and pads no row of the
plugin's partition (the partition is what the kernel keeps as it is).
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import (
    is_online,
    quantized_tensors,
)


def quantized_routed_bytes(experts: Any) -> int | None:
    """The bytes of the quantized tensors the online method of ``experts``
    (vLLM's ``RoutedExperts``, built on ``meta``) hands its kernel; None
    where its method does not quantize while loading, or cannot be run so
    (a method with no ``_setup_kernel``: vLLM 0.34's LUT-B; one
    re-quantizing a checkpoint's quantized experts). Run on ``meta`` with
    the online quantizers stood in (``stand_ins.online_method_quantizers``)
    and vLLM's config current."""
    import torch

    method = experts.quant_method
    if not is_online(method) or method.requantization_source is not None:
        return None
    config = experts.moe_config
    try:
        with torch.device("meta"):
            tensors = quantized_tensors(
                method,
                config.intermediate_size_per_partition,
                config.hidden_dim,
                experts.local_num_experts,
            )
    except Exception:  # as the plugin's rule: what cannot be run is not sized
        return None
    return sum(t.numel() * t.element_size() for t in tensors.values())
