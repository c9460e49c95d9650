"""INT4 W4A16: 4-bit integers packed eight per int32, one scale per group.

Published as compressed-tensors ``pack-quantized`` with integer weights in
groups (INT4 conversions in the style of Kimi-K2-Thinking, groups of 32,
symmetric); vLLM 0.33.0 loads the experts with
``CompressedTensorsWNA16MoEMethod``. Its rule: the partition is whole groups
(``create_weights``' check) and, on Marlin, what
``check_moe_marlin_supports_config`` takes with tile padding (Marlin pads at
weight preparation: ``marlin_moe_padded_intermediate``).
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.formats.compressed_tensors import (
    EVERYTHING_BUT_ROUTED_EXPERTS,
    compressed_tensors_config,
    weight_signature,
)
from vllm_kimi_k3_moe.formats.layouts import (
    FLOAT_SCALES,
    SCALE,
    ExpertScalar,
    ExpertTensorLayout,
    ExpertTensors,
)
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    KimiK3Format,
    PartitionRule,
    QuantizationScheme,
    config_with_partition,
)

GROUP = 32  # input values per scale in the published conversions
WEIGHTS = {
    "num_bits": 4,
    "type": "int",
    "strategy": "group",
    "group_size": GROUP,
    "symmetric": True,
    "dynamic": False,
}
MARLIN_BACKENDS = ("MARLIN", "BATCHED_MARLIN")


def tensors(num_bits: int, group_size: int) -> ExpertTensors:
    """Integers packed into int32 (32 // num_bits per element), one scale
    per group of ``group_size`` input values, and the stored logical shape."""
    return ExpertTensors(
        f"INT{num_bits} W{num_bits}A16",
        (
            ExpertTensorLayout("weight_packed", 32 // num_bits, dtypes=("I32",)),
            ExpertTensorLayout(SCALE, group_size, dtypes=FLOAT_SCALES),
        ),
        (ExpertScalar("weight_shape", (2,), ("I64", "I32")),),
    )


def _recognises(scheme: QuantizationScheme) -> CheckpointFormat | None:
    bits, kind, strategy, group = weight_signature(scheme.expert_weights)
    if (
        scheme.quant_method != "compressed-tensors"
        or (kind, strategy) != ("int", "group")
        or bits not in (4, 8)
        or not group
    ):
        return None
    return CheckpointFormat(
        W4A16,
        f"compressed-tensors INT{bits} W{bits}A16, groups of {group}",
        tensors(bits, group),
    )


def _accepts(method: Any, hidden: int, n: int) -> bool:
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        check_moe_marlin_supports_config,
    )

    group = method.group_size
    if group > 0 and n % group:
        return False  # create_weights: "... divisible by group_size"
    if method.wna16_backend.name not in MARLIN_BACKENDS:
        return True
    config = config_with_partition(method, n)
    return check_moe_marlin_supports_config(config, group, allow_tile_padding=True)


W4A16 = KimiK3Format(
    name="w4a16",
    title="compressed-tensors INT4 W4A16",
    vllm_methods=("CompressedTensorsWNA16MoEMethod",),
    loads_as="CompressedTensorsWNA16MoEMethod",
    partition_rule=PartitionRule(
        "group_size divisibility and check_moe_marlin_supports_config",
        accepts=_accepts,
    ),
    alignment=GROUP,
    alignment_unit="INT4 scale groups",
    stored_as="INT4-packed (W4A16)",
    moe_backends=("marlin", "humming"),
    published_config=compressed_tensors_config(
        "pack-quantized", WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    recognises=_recognises,
    tensors_of_method=lambda method: tensors(method.num_bits, method.group_size),
    # The same method serves ungrouped (channel-wise) INT: not this format.
    is_method=lambda method: method.group_size > 0,
)
