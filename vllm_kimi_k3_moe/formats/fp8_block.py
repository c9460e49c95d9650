"""FP8 block: float8 weights with one scale per [128, 128] block.

Published as compressed-tensors ``float-quantized`` (block strategy); vLLM
0.33.0 loads the experts with ``CompressedTensorsW8A8Fp8MoEMethod``. Its
rule is ``pad_tp_shard_to_weight_blocks`` (``oracle/fp8.py``): whole
checkpoint blocks per GPU, which also satisfies
``validate_fp8_block_shape_moe`` in ``create_weights``. Where the even slice
splits a block (TP16: 192 rows, TP32 and TP8 x DP4: 96), GPU r holds rows
[r*n, (r+1)*n) of 3072 for its partition n, with their own block scales, and
the GPUs past the end none (``record.rank_rows``), as vLLM's native FP8
method loads them (``tp_shard_with_padding``).
"""

from __future__ import annotations

import math
from typing import Any

from vllm_kimi_k3_moe.formats.compressed_tensors import (
    ATTENTION_RESIDUALS,
    ROUTER,
    VISION,
    compressed_tensors_config,
    weight_signature,
)
from vllm_kimi_k3_moe.formats.layouts import (
    FLOAT_SCALES,
    SCALE,
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

BLOCK = (128, 128)  # (output rows, input columns) per scale

WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "block",
    "block_structure": list(BLOCK),
    "symmetric": True,
    "dynamic": False,
}
GROUP_INPUTS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "group",
    "group_size": 128,
    "symmetric": True,
    "dynamic": True,
}
# Every linear layer vLLM can shard in whole 128-blocks at TP8, TP16 and
# TP32 is FP8; these cannot be (vLLM refuses a per-rank slice of 3-12 KDA
# heads, 576 MLA rows, 1056 or 2112 dense rows, 192 shared rows with "not
# divisible by weight quantization block_n = 128"), so a checkpoint vLLM
# serves at those sizes leaves them BF16, as do the router and lm_head.
UNSHARDABLE = [
    *VISION,
    "lm_head",
    ROUTER,
    ATTENTION_RESIDUALS,
    r"re:.*self_attn\.(q|k|v|g|b|f_a)_proj",  # KDA's fused input projection
    r"re:.*self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj)",  # MLA
    r"re:.*\.mlp\..*",
    r"re:.*block_sparse_moe\.shared_experts\..*",
]


def tensors(block_out: int, block_in: int) -> ExpertTensors:
    """float8 weights, one float scale per ``block_out x block_in`` block."""
    return ExpertTensors(
        "FP8 block",
        (
            ExpertTensorLayout("weight", dtypes=("F8_E4M3",)),
            ExpertTensorLayout(SCALE, block_in, block_out, dtypes=FLOAT_SCALES),
        ),
    )


def rows_per_group(block_out: int, block_in: int) -> int:
    """Intermediate rows a GPU must hold whole: w1/w3's output blocks and
    w2's input blocks both run along them."""
    return math.lcm(block_out, block_in)


def _recognises(scheme: QuantizationScheme) -> CheckpointFormat | None:
    weights = scheme.expert_weights
    if scheme.quant_method != "compressed-tensors" or weight_signature(weights)[:3] != (
        8,
        "float",
        "block",
    ):
        return None
    block_out, block_in = (weights or {}).get("block_structure") or BLOCK
    return CheckpointFormat(
        FP8_BLOCK,
        f"compressed-tensors FP8 block [{block_out}, {block_in}]",
        tensors(block_out, block_in),
        rows_per_group(block_out, block_in),
        "FP8 blocks",
    )


def _accepts(method: Any, hidden: int, n: int) -> bool:
    """Whole checkpoint blocks: what ``pad_tp_shard_to_weight_blocks`` leaves
    unpadded (a partition it would round up is not accepted)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
        pad_tp_shard_to_weight_blocks,
    )

    config = config_with_partition(method, n)
    return not pad_tp_shard_to_weight_blocks(config, method.weight_block_size)


def _row_group(method: Any) -> int:
    return rows_per_group(*method.weight_block_size)


def _tensors_of_method(method: Any) -> ExpertTensors:
    return tensors(*method.weight_block_size)


FP8_BLOCK = KimiK3Format(
    name="fp8-block",
    title="compressed-tensors FP8 block [128,128]",
    vllm_methods=("CompressedTensorsW8A8Fp8MoEMethod",),
    loads_as="CompressedTensorsW8A8Fp8MoEMethod",
    partition_rule=PartitionRule(
        "pad_tp_shard_to_weight_blocks",
        accepts=_accepts,
        row_group=_row_group,
        kernel_may_allocate_more=False,  # whole blocks are what they take
    ),
    stored_as="FP8 with block scales",
    moe_backends=("marlin", "triton", "humming"),
    published_config=compressed_tensors_config(
        "float-quantized", WEIGHTS, GROUP_INPUTS, UNSHARDABLE
    ),
    recognises=_recognises,
    tensors_of_method=_tensors_of_method,
    # The same method serves FP8 per channel or per tensor: not this format.
    is_method=lambda method: bool(method.block_quant),
)
