"""What a rank's linear layers keep when the method that quantizes a BF16
checkpoint while vLLM loads it quantizes them too (``vllm serve
--quantization fp8_per_block``, ``fp8_per_tensor``, ``fp8_per_channel``,
``mxfp8``, ``mxfp4``: each shorthand's ``linear`` spec).

An online linear method's ``create_weights`` allocates the BF16 weight it
loads (on ``meta`` until then); its ``process_weights_after_loading``
quantizes it, hands it to its linear kernel's own preparation and keeps what
that leaves. So a build on ``meta`` shows the BF16, never what the GPU
keeps. Here each such layer's own ``process_weights_after_loading`` is run
on ``meta``, with the quantizers a CPU box lacks stood in
(``stand_ins.online_method_quantizers``) and the all-reduce of a weight's
maximum over its GPUs (``stand_ins.all_reduce_over_one_gpu``: on ``meta``
it changes no shape): what it leaves, the quantized weight and its scales as
the kernel keeps them, is what the rank holds. A layer whose processing
cannot be run so stays the BF16 it allocated (counted as more than it is,
never less).
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    all_reduce_over_one_gpu,
    online_method_quantizers,
)


def quantize_online_linear_layers(model: Any) -> tuple[int, int]:
    """Run each online linear method of ``model`` (built on ``meta``, its
    ``VllmConfig`` current) as vLLM runs it once the layer is loaded: (layers
    quantized, layers left as the BF16 they allocated)."""
    # vLLM's online linear methods' base (the same on 0.33 and 0.34)
    from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase

    quantized = left = 0
    with online_method_quantizers(), all_reduce_over_one_gpu():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, OnlineLinearBase):
                continue
            try:
                method.process_weights_after_loading(module)
            except Exception:  # what cannot be run stays as allocated
                left += 1
                continue
            quantized += 1
    return quantized, left
