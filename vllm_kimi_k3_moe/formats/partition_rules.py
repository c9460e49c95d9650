"""Per quantization method: the smallest per-rank MoE partition its kernel takes.

Each rule asks vLLM 0.33.0's own code which partitions a method accepts; the
one number restated here (NVFP4's 128-row scale tiles, which vLLM computes
inside a function that needs a GPU) is held to vLLM's weight preparation by
the test suite. The methods, and the check each rule calls, for the formats
Kimi-K3 is published in:

==========================================  =====================================
method (format)                             rule
==========================================  =====================================
``Mxfp4MoEMethod`` (released MXFP4,         owns its padding: its
rewritten to native ``mxfp4``)              ``maybe_roundup_sizes`` (the MXFP4
                                            sizing oracle
                                            ``mxfp4_round_up_hidden_size_and_
                                            intermediate_size``)
``CompressedTensorsW4A4Mxfp4MoEMethod``     that oracle, asked for the kernel the
(other compressed-tensors MXFP4)            method selected (it does not ask)
``CompressedTensorsW8A8Fp8MoEMethod``,      ``pad_tp_shard_to_weight_blocks``
block [128, 128] (FP8 block)                (oracle/fp8.py): whole checkpoint
                                            blocks per rank, which also satisfies
                                            ``validate_fp8_block_shape_moe`` in
                                            ``create_weights`` and switches the
                                            loader to block-aligned TP shards
``Fp8MoEMethod`` (native FP8)               owns its padding:
                                            ``resolve_fp8_moe_weight_block_shape``
                                            in its ``__init__`` refines or pads
``CompressedTensorsW4A4Nvfp4MoEMethod``,    allocation at the logical size, but
``ModelOptNvFp4FusedMoE`` (NVFP4)           for the CUTLASS-family kernels whose
                                            weight prep refuses a pad
                                            (``prepare_nvfp4_moe_layer_for_fi_or_
                                            cutlass``: ``swizzle_blockscale``
                                            pads the 2N gate/up scale rows to
                                            128); the others zero-pad at prep
                                            (``align_fp4_moe_weights_for_fi``,
                                            Marlin, Humming)
``CompressedTensorsWNA16MoEMethod``         ``create_weights``' group check and,
(INT4 W4A16)                                on Marlin,
                                            ``check_moe_marlin_supports_config``
                                            with tile padding (Marlin pads at
                                            prep: ``marlin_moe_padded_
                                            intermediate``)
``UnquantizedFusedMoEMethod`` (BF16)        owns its padding: its
                                            ``maybe_roundup_sizes``
                                            (``unquantized_round_up_hidden_size_
                                            and_intermediate_size``)
==========================================  =====================================

A method not listed has no rule: the caller keeps vLLM alone's partition.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.formats.method_kinds import method_kind

RoundUp = Callable[[int, int], int]  # (hidden, n) -> the method's own n'

# Partitions are searched in steps of the finest quantization group Kimi-K3
# is published with (NVFP4: 16 values per scale).
SEARCH_STEP = 16


@dataclass(frozen=True)
class PartitionRule:
    """How one quantization method's kernel constrains the partition."""

    name: str  # the vLLM check it calls, for the startup log
    accepts: Callable[[Any, int, int], bool] | None = None  # (method, hidden, n)
    adopt: Callable[[Any], None] | None = None  # (method): what else it needs

    def smallest_partition(
        self, method: Any, hidden: int, asked: int, round_up: RoundUp, limit: int
    ) -> int:
        """The smallest n >= ``asked`` (up to ``limit``) that the method's
        own rounding leaves as it is and that ``accepts``; ``limit`` if none."""
        n = asked
        while n < limit:
            if round_up(hidden, n) == n and (
                self.accepts is None or self.accepts(method, hidden, n)
            ):
                return n
            n = (n // SEARCH_STEP + 1) * SEARCH_STEP
        return limit


def _config_with_partition(method: Any, n: int) -> Any:
    """A copy of the method's ``FusedMoEConfig`` with a per-rank partition of
    ``n``, for vLLM checks that read the partition from the config."""
    config = copy.copy(method.moe)
    config.intermediate_size_per_partition = n
    config.intermediate_size_per_partition_unpadded = n
    return config


def _ct_mxfp4_accepts(method: Any, hidden: int, n: int) -> bool:
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        mxfp4_round_up_hidden_size_and_intermediate_size,
    )

    backend = (
        Mxfp4MoeBackend.CUTLASS_MXFP4_MXFP4
        if method.use_cutlass_mxfp4
        else method.mxfp4_backend
    )
    _, padded = mxfp4_round_up_hidden_size_and_intermediate_size(
        backend, hidden, n, activation=method.moe.activation
    )
    return padded == n


def _fp8_block_accepts(method: Any, hidden: int, n: int) -> bool:
    """Whole checkpoint blocks: what ``pad_tp_shard_to_weight_blocks`` leaves
    unpadded (a partition it would round up is not accepted)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
        pad_tp_shard_to_weight_blocks,
    )

    config = _config_with_partition(method, n)
    return not pad_tp_shard_to_weight_blocks(config, method.weight_block_size)


def _fp8_block_adopt(method: Any) -> None:
    """Load whole checkpoint blocks per rank, as vLLM's native FP8 method
    does for a partition that splits a block (``tp_shard_with_padding``):
    rank r holds rows [r*n, (r+1)*n) of 3072 for its partition n, with their
    own block scales."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
        pad_tp_shard_to_weight_blocks,
    )

    pad_tp_shard_to_weight_blocks(method.moe, method.weight_block_size)


# ``swizzle_blockscale`` (quantization/utils/nvfp4_utils.py) lays NVFP4 block
# scales out in tiles of 128 rows; for the kernels below,
# ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` (flashinfer_fp4_moe.py) raises
# NotImplementedError when that adds rows to a gated w13 (2N rows). The test
# suite runs that code to hold this number to it.
NVFP4_SWIZZLE_ROW_TILE = 128


def _nvfp4_accepts(method: Any, hidden: int, n: int) -> bool:
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    refusing_pad = {
        NvFp4MoeBackend.VLLM_CUTLASS,
        NvFp4MoeBackend.FLASHINFER_CUTLASS,
        NvFp4MoeBackend.FLASHINFER_CUTEDSL_BATCHED,
        NvFp4MoeBackend.FLASHINFER_B12X,
    }
    if method.nvfp4_backend not in refusing_pad:
        return True  # the others zero-pad at weight prep (64-row alignment)
    return (2 * n) % NVFP4_SWIZZLE_ROW_TILE == 0


def _wna16_accepts(method: Any, hidden: int, n: int) -> bool:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
        WNA16MoEBackend,
    )
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        check_moe_marlin_supports_config,
    )

    group = method.group_size
    if group > 0 and n % group:
        return False  # create_weights: "... divisible by group_size"
    if method.wna16_backend in (
        WNA16MoEBackend.MARLIN,
        WNA16MoEBackend.BATCHED_MARLIN,
    ):
        return check_moe_marlin_supports_config(
            _config_with_partition(method, n), group, allow_tile_padding=True
        )
    return True


OWNS_ITS_PADDING = PartitionRule("the method's own maybe_roundup_sizes")
NVFP4_RULE = PartitionRule(
    "swizzle_blockscale row tiles on CUTLASS-family kernels", accepts=_nvfp4_accepts
)

# By method kind (``method_kinds``).
RULES: dict[str, PartitionRule] = {
    "native-mxfp4": OWNS_ITS_PADDING,
    "bf16": OWNS_ITS_PADDING,
    "native-fp8": OWNS_ITS_PADDING,
    "ct-mxfp4": PartitionRule(
        "mxfp4_round_up_hidden_size_and_intermediate_size for its kernel",
        accepts=_ct_mxfp4_accepts,
    ),
    "ct-fp8-block": PartitionRule(
        "pad_tp_shard_to_weight_blocks",
        accepts=_fp8_block_accepts,
        adopt=_fp8_block_adopt,
    ),
    "ct-nvfp4": NVFP4_RULE,
    "modelopt-nvfp4": NVFP4_RULE,
    "ct-wna16": PartitionRule(
        "group_size divisibility and check_moe_marlin_supports_config",
        accepts=_wna16_accepts,
    ),
}


def rule_for(method: Any) -> PartitionRule | None:
    """The rule for ``method``, or None when the plugin knows nothing of it."""
    kind = method_kind(method)
    return None if kind is None else RULES.get(kind)


BACKEND_ATTRIBUTES = (
    "mxfp4_backend",
    "fp8_backend",
    "nvfp4_backend",
    "wna16_backend",
    "unquantized_backend",
)


def backend_name(method: Any) -> str:
    """The MoE kernel ``method`` selected, as vLLM's backend enums name it."""
    if getattr(method, "use_cutlass_mxfp4", False):
        return "cutlass_mxfp4_mxfp4"
    for attribute in BACKEND_ATTRIBUTES:
        backend = getattr(method, attribute, None)
        if backend is not None:
            return str(getattr(backend, "name", backend)).lower()
    return "unknown backend"
