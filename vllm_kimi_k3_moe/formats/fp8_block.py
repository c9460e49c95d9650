"""FP8 block: float8 weights with one scale per [128, 128] block.

Published as compressed-tensors ``float-quantized`` (block strategy); vLLM
0.33.0 loads the experts with ``CompressedTensorsW8A8Fp8MoEMethod``. Its
rule is ``pad_tp_shard_to_weight_blocks`` (``oracle/fp8.py``): whole
checkpoint blocks per rank, which also satisfies
``validate_fp8_block_shape_moe`` in ``create_weights`` and switches vLLM's
loader to block-aligned TP shards (rank r holds rows [r*n, (r+1)*n) of 3072
for its partition n, with their own block scales; the ranks past the end
hold none).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_kimi_k3_moe.compat import VLLM
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
    RowRange,
    config_with_partition,
    even_rows,
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


def block_aligned_rows(
    intermediate: int, ranks: int, block: tuple[int, int] = BLOCK
) -> list[RowRange]:
    """The intermediate rows [start, end) each of ``ranks`` TP ranks loads
    with the plugin. Where the even slice splits a square block,
    ``pad_tp_shard_to_weight_blocks`` rounds the partition n up to whole
    blocks and vLLM's loader (``_load_model_weight_or_group_weight_scale``,
    ``tp_shard_with_padding``) gives rank r rows [r*n, (r+1)*n) clipped to
    the checkpoint: the first ranks hold whole blocks, the last ones none
    (TP32: ranks 0-23 128 rows each, 24-31 none). Otherwise the even slice."""
    block_n, block_k = block
    share = intermediate // ranks
    if block_n != block_k or ranks == 1 or share % block_n == 0:
        return even_rows(intermediate, ranks)
    n = -(-share // block_n) * block_n
    return [
        (min(rank * n, intermediate), min((rank + 1) * n, intermediate))
        for rank in range(ranks)
    ]


# vLLM's KimiMoE pads the MoE at model level to this many rows per TP rank
# (``min_moe_intermediate_per_partition``) when the TP slice is smaller.
MODEL_LEVEL_MINIMUM = 256


def split_refusal(text_config: dict[str, Any], tp_size: int, group: int) -> str | None:
    """Why vLLM 0.33.0 cannot build FP8 block experts split over ``group``
    GPUs (TP x DP) without expert parallelism, or None. A GPU's share of
    each expert must be whole 128-row blocks (``create_weights``:
    ``validate_fp8_block_shape``) unless the plugin loads whole blocks per
    rank, which it does where vLLM pads the MoE at model level: TP > 1 and
    the TP slice under ``min_moe_intermediate_per_partition`` (256). Data
    parallelism alone splits the rows without that padding (TP8 x DP2: 192
    rows each, refused)."""
    intermediate = text_config["moe_intermediate_size"]
    share = intermediate // group
    minimum = text_config.get("min_moe_intermediate_per_partition", MODEL_LEVEL_MINIMUM)
    if share % BLOCK[0] == 0 or (tp_size > 1 and intermediate // tp_size < minimum):
        return None
    return (
        f"each of the {group} GPUs would hold {share} of every expert's "
        f"{intermediate} rows, which splits FP8's {BLOCK[0]}-row blocks: "
        f"{VLLM}'s FP8 block method refuses that (not divisible by block_n) "
        "unless it pads the MoE at model level, at a TP slice under "
        f"{minimum} rows; use expert parallelism (--ep) or a larger TP"
    )


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
        functools.partial(block_aligned_rows, block=(block_out, block_in)),
        f"whole {block_out}-row FP8 blocks",
    )


def _accepts(method: Any, hidden: int, n: int) -> bool:
    """Whole checkpoint blocks: what ``pad_tp_shard_to_weight_blocks`` leaves
    unpadded (a partition it would round up is not accepted)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
        pad_tp_shard_to_weight_blocks,
    )

    config = config_with_partition(method, n)
    return not pad_tp_shard_to_weight_blocks(config, method.weight_block_size)


def _adopt(method: Any) -> None:
    """Load whole checkpoint blocks per rank, as vLLM's native FP8 method
    does for a partition that splits a block (``tp_shard_with_padding``)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
        pad_tp_shard_to_weight_blocks,
    )

    pad_tp_shard_to_weight_blocks(method.moe, method.weight_block_size)


def _tensors_of_method(method: Any) -> ExpertTensors:
    return tensors(*method.weight_block_size)


FP8_BLOCK = KimiK3Format(
    name="fp8-block",
    title="compressed-tensors FP8 block [128,128]",
    vllm_methods=("CompressedTensorsW8A8Fp8MoEMethod",),
    loads_as="CompressedTensorsW8A8Fp8MoEMethod",
    partition_rule=PartitionRule(
        "pad_tp_shard_to_weight_blocks", accepts=_accepts, adopt=_adopt
    ),
    # The loader gives each rank whole blocks (above): any split of the
    # rows into whole rows works.
    alignment=1,
    alignment_unit="rows",
    stored_as="FP8 with block scales",
    moe_backends=("marlin", "triton", "humming"),
    published_config=compressed_tensors_config(
        "float-quantized", WEIGHTS, GROUP_INPUTS, UNSHARDABLE
    ),
    recognises=_recognises,
    tensors_of_method=_tensors_of_method,
    # The same method serves FP8 per channel or per tensor: not this format.
    is_method=lambda method: bool(method.block_quant),
    split_refusal=split_refusal,
)
