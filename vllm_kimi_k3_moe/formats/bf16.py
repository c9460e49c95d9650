"""BF16: Kimi-K3 dequantized, no ``quantization_config`` at all.

vLLM 0.33.0 loads the experts with ``UnquantizedFusedMoEMethod``, whose
``maybe_roundup_sizes`` rounds for its kernel itself.
"""

from __future__ import annotations

from vllm_kimi_k3_moe.formats.layouts import ExpertTensorLayout, ExpertTensors
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    KimiK3Format,
    QuantizationScheme,
    owns_its_padding,
)

TENSORS = ExpertTensors("BF16", (ExpertTensorLayout("weight", dtypes=("BF16",)),))


def _recognises(scheme: QuantizationScheme) -> CheckpointFormat | None:
    if scheme.quant_method is not None:
        return None
    return CheckpointFormat(BF16, "BF16 (no quantization_config)", TENSORS)


BF16 = KimiK3Format(
    name="bf16",
    title="BF16",
    vllm_methods=("UnquantizedFusedMoEMethod",),
    loads_as="UnquantizedFusedMoEMethod",
    partition_rule=owns_its_padding(),
    stored_as="unquantized BF16",
    moe_backends=("marlin", "triton", "batched_triton", "humming"),
    published_config=None,
    recognises=_recognises,
    tensors_of_method=lambda method: TENSORS,
)
