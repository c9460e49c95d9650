"""Compressed-tensors INT W4A16 / W8A16: integers packed into int32, one
scale per group.

Published as compressed-tensors ``pack-quantized`` with integer weights in
groups (INT4 conversions in the style of Kimi-K2-Thinking: groups of 32,
symmetric); any bit width vLLM 0.33.0 takes (4 or 8), group size and
symmetry is the same format to vLLM, which loads the experts with
``CompressedTensorsWNA16MoEMethod``; its rule is ``int_groups.RULE``.
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.formats import int_groups
from vllm_kimi_k3_moe.formats.compressed_tensors import (
    EVERYTHING_BUT_ROUTED_EXPERTS,
    compressed_tensors_config,
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
    QuantizationScheme,
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
BITS = (4, 8)  # what vLLM 0.33.0's WNA16 MoE method takes
ZERO_POINT = "weight_zero_point"


def tensors(num_bits: int, group_size: int, symmetric: bool = True) -> ExpertTensors:
    """Integers packed into int32 (32 // num_bits per element), one scale per
    group of ``group_size`` input values, the zero points of an asymmetric
    scheme packed along the output, and the stored logical shape."""
    pack = 32 // num_bits
    sharded = [
        ExpertTensorLayout("weight_packed", pack, dtypes=("I32",)),
        ExpertTensorLayout(SCALE, group_size, dtypes=FLOAT_SCALES),
    ]
    if not symmetric:
        sharded.append(ExpertTensorLayout(ZERO_POINT, group_size, pack, ("I32",)))
    return ExpertTensors(
        f"INT{num_bits} W{num_bits}A16",
        tuple(sharded),
        (ExpertScalar("weight_shape", (2,), ("I64", "I32")),),
    )


def _recognises(scheme: QuantizationScheme) -> CheckpointFormat | None:
    weights = scheme.expert_weights or {}
    bits, kind = weights.get("num_bits"), weights.get("type")
    strategy, group = weights.get("strategy"), weights.get("group_size")
    if (
        scheme.quant_method != "compressed-tensors"
        or (kind, strategy) != ("int", "group")
        or bits not in BITS
        or not group
    ):
        return None
    symmetric = weights.get("symmetric", True) is not False
    scheme_name = "symmetric" if symmetric else "asymmetric"
    name = f"compressed-tensors INT{bits} W{bits}A16, groups of {group}"
    return int_groups.checkpoint_format(
        W4A16, f"{name}, {scheme_name}", tensors(bits, group, symmetric), bits, group
    )


def _tensors_of_method(method: Any) -> ExpertTensors:
    return tensors(method.num_bits, method.group_size, method.symmetric)


W4A16 = KimiK3Format(
    name="w4a16",
    title="compressed-tensors INT4 W4A16 (and W8A16)",
    vllm_methods=("CompressedTensorsWNA16MoEMethod",),
    loads_as="CompressedTensorsWNA16MoEMethod",
    partition_rule=int_groups.RULE,
    stored_as="INT-packed (WNA16)",
    moe_backends=("marlin", "humming"),
    published_config=compressed_tensors_config(
        "pack-quantized", WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    recognises=_recognises,
    tensors_of_method=_tensors_of_method,
    # The same method serves ungrouped (channel-wise) INT: not this format.
    is_method=lambda method: method.group_size > 0,
)
