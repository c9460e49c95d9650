"""What the integer weight-only formats share: their partition rule.

Integer weights in groups (W4A16 and W8A16: GPTQ, AutoRound, AWQ and
compressed-tensors conversions) reach one of vLLM 0.33.0's WNA16 MoE
methods: ``CompressedTensorsWNA16MoEMethod``, ``AutoAWQMoEMethod`` or
``AutoGPTQMoEMethod``. All three select their kernel with
``select_wna16_moe_backend`` while they are constructed, where Marlin (the
kernel every NVIDIA GPU runs them on) must pass
``check_moe_marlin_supports_config``: the partition is whole groups; it pads
the rest at weight preparation (``marlin_moe_padded_intermediate``), so the
plugin allocates Marlin's padded rows (zero) itself: nothing is padded, or
held twice, while the weights are prepared.

A GPU whose even slice splits a group (groups of 128 over 32 GPUs: 96 rows)
holds whole groups instead; its pad must dequantize to zero, and an integer
zero code does not (4-bit 0 is -8 after the 2^3 offset): its scales stay 0.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_kimi_k3_moe.formats.layouts import ExpertTensors
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    KimiK3Format,
    PartitionRule,
    config_with_partition,
)

MARLIN_BACKENDS = ("MARLIN", "BATCHED_MARLIN")


def group_size(method: Any) -> int:
    """Input values per scale of ``method``'s experts; -1 per channel."""
    size = getattr(method, "group_size", None)
    if size is None:  # AutoAWQ and AutoGPTQ keep it on their config
        size = method.quant_config.group_size
    return -1 if size is None else size


def num_bits(method: Any) -> int:
    bits = getattr(method, "num_bits", None)
    return bits if bits is not None else method.quant_config.weight_bits


def backend(method: Any) -> Any:
    """The ``WNA16MoEBackend`` the method selected."""
    found = getattr(method, "wna16_backend", None)
    return found if found is not None else method.wna16_moe_backend


def row_group_of(bits: int, group: int) -> int:
    """Rows a GPU must hold whole: a scale group (``group`` values; -1 per
    channel), and an int32 of packed values or zero points (some layouts
    pack along the rows)."""
    return math.lcm(max(group, 1), 32 // bits)


def row_group(method: Any) -> int:
    return row_group_of(num_bits(method), group_size(method))


def _accepts(method: Any, hidden: int, n: int) -> bool:
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        check_moe_marlin_supports_config,
    )

    group = group_size(method)
    if group > 0 and n % group:
        return False  # create_weights: "... divisible by group_size"
    if backend(method).name not in MARLIN_BACKENDS:
        return True
    config = config_with_partition(method, n)
    return check_moe_marlin_supports_config(config, group, allow_tile_padding=True)


GROUP_UNIT = "INT scale groups"


def checkpoint_format(
    record: KimiK3Format, name: str, tensors: ExpertTensors, bits: int, group: int
) -> CheckpointFormat:
    """A checkpoint of integer ``bits`` in groups of ``group``: a GPU holds
    whole groups (``row_group_of``)."""
    return CheckpointFormat(
        record, name, tensors, row_group_of(bits, group), GROUP_UNIT
    )


RULE = PartitionRule(
    "group_size divisibility and check_moe_marlin_supports_config",
    accepts=_accepts,
    row_group=row_group,
    zero_pad_scales=True,
    kernel_may_allocate_more=False,  # Marlin pads at weight preparation
)
