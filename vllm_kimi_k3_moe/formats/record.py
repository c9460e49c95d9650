"""What a Kimi-K3 format is: the record type every format module fills in.

Plain Python: nothing here imports torch or vLLM. The partition rules'
checks call vLLM, importing it only when a layer is being built; what a
kernel keeps of a rule's partitions, and which the layout chooser tries, is
asked beside the chooser (``model_executor.layers.fused_moe.kernel_rows``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kimi_k3_moe.formats.layouts import ExpertTensors

RowRange = tuple[int, int]  # [start, end) of an expert's intermediate rows


def _no_group(method: Any) -> int:
    return 1


@dataclass(frozen=True)
class PartitionRule:
    """How one quantization method's kernel constrains the per-rank
    partition: ``accepts(method, hidden, n)`` calls the vLLM check that
    enforces it; ``row_group(method)`` is how many intermediate rows share
    one scale (or zero point, or packed element) along the rows, so that a
    GPU holding part of a group would need another GPU's scales. What the
    method's kernel keeps and takes of a partition is asked with it
    (``kernel_rows.resident``, ``kernel_rows.search``)."""

    name: str  # the vLLM check it calls, for the startup log
    accepts: Callable[[Any, int, int], bool] | None = None
    row_group: Callable[[Any], int] = _no_group
    # vLLM's block-aligned loader gives a pad's scales 1, FP8's identity.
    # Where a zero weight code is not a zero value (INT: 2^(bits-1) is), the
    # pad's scales and zero points must stay 0 to dequantize to zero.
    zero_pad_scales: bool = False
    # Whether some kernel of the method allocates more than whole groups
    # (MXFP4 Marlin: 128 rows where 64 would be whole blocks of 32): then a
    # GPU's rows depend on the kernel (``rank_rows``' ``partition``).
    kernel_may_allocate_more: bool = True
    # Whether the checkpoint's rows come in these groups, so a GPU holding
    # part of one would need another GPU's scales; not for a method that
    # quantizes BF16 while loading (its groups start at each GPU's first row)
    groups_in_checkpoint: bool = True


def owns_its_padding(row_group: Callable[[Any], int] = _no_group) -> PartitionRule:
    """The rule of a method whose ``maybe_roundup_sizes`` already rounds for
    its kernel."""
    return PartitionRule("the method's own maybe_roundup_sizes", row_group=row_group)


def config_with_partition(method: Any, n: int) -> Any:
    """A copy of ``method``'s ``FusedMoEConfig`` with a per-rank partition of
    ``n`` rows: vLLM's partition checks read the partition from it."""
    config = copy.copy(method.moe)
    config.intermediate_size_per_partition = n
    config.intermediate_size_per_partition_unpadded = n
    return config


def whole_group_partition(share: int, group: int) -> int:
    """The smallest partition of whole ``group``-row groups holding a GPU's
    ``share`` of the rows: the share itself where the group divides it."""
    return -(-share // group) * group


def rank_rows(
    intermediate: int, ranks: int, group: int = 1, partition: int | None = None
) -> list[RowRange]:
    """The rows [start, end) of every expert each of ``ranks`` GPUs loads
    with the plugin (the GPUs that shard every expert: TP x DP x PCP without
    expert parallelism; start == end: none). Where ``group`` divides the
    even slice, that slice (vLLM's loader: [r*n, (r+1)*n) for n =
    intermediate // ranks). Otherwise every GPU holds whole groups: vLLM's
    block-aligned loader (``tp_shard_with_padding``) gives GPU r rows
    [r*p, (r+1)*p) clipped to the checkpoint, p the allocated ``partition``
    (by default the smallest of whole groups), so the first GPUs hold p rows
    and the last ones none (groups of 128 over 32 GPUs: GPUs 0-23 128 rows
    each, 24-31 none)."""
    share = intermediate // ranks
    if share % group == 0:
        return [(rank * share, (rank + 1) * share) for rank in range(ranks)]
    p = partition or whole_group_partition(share, group)
    return [
        (min(rank * p, intermediate), min((rank + 1) * p, intermediate))
        for rank in range(ranks)
    ]


@dataclass(frozen=True)
class QuantizationScheme:
    """What a checkpoint's config files say about its routed experts."""

    quant_method: str | None  # None: no quantization_config (BF16)
    ct_format: str | None = None  # compressed-tensors' "format"
    # the weights of the compressed-tensors group that targets the experts
    expert_weights: dict[str, Any] | None = None
    quant_algo: str | None = None  # ModelOpt's
    # the whole quantization_config, for formats that keep their parameters
    # at its top level (AutoAWQ, AutoGPTQ)
    config: dict[str, Any] | None = None


@dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint recognised as one Kimi-K3 format, with its parameters."""

    format: KimiK3Format
    name: str  # as check's summary names it, parameters included
    tensors: ExpertTensors
    # intermediate rows per scale group (FP8: per block), and what those are
    # called ("FP8 blocks"): a GPU holds whole groups (``rank_rows``)
    row_group: int = 1
    row_group_unit: str = "rows"

    @property
    def loads_as(self) -> str:
        return self.format.loads_as

    @property
    def row_split_rule(self) -> str:
        """How a GPU's rows are split where the even slice splits a group."""
        return f"whole {self.row_group}-row {self.row_group_unit}"

    def rank_rows(
        self, intermediate: int, ranks: int, partition: int | None = None
    ) -> list[RowRange]:
        """[start, end) of the intermediate rows GPU r of the ``ranks`` that
        shard every expert loads, for each r (``record.rank_rows``;
        ``partition``: the kernel's allocation, where it is known)."""
        return rank_rows(intermediate, ranks, self.row_group, partition)


@dataclass(frozen=True)
class KimiK3Format:
    """One format Kimi-K3 is published in, as every part of the package
    needs it. ``name`` is the one spelling used by the command line, JSON,
    tests and messages."""

    name: str
    title: str  # "native MXFP4 (the release)"
    # vLLM 0.33.0's MoE method classes that load its experts (matched by
    # name along the method's MRO, so no method module is imported) and
    # what else a method must show to be this format (FP8: block scales)
    vllm_methods: tuple[str, ...]
    loads_as: str  # what check says vLLM loads the experts with
    partition_rule: PartitionRule
    # how its expert tensors look, for check's "the expert tensors are ..."
    stored_as: str
    # --moe-backend names plan offers (NVIDIA kernels vLLM selects for it)
    moe_backends: tuple[str, ...]
    # the quantization_config of its published checkpoint (None: BF16)
    published_config: dict[str, Any] | None
    recognises: Callable[[QuantizationScheme], CheckpointFormat | None]
    # (vLLM method) -> the checkpoint tensors its experts' parameters load
    tensors_of_method: Callable[[Any], ExpertTensors]
    is_method: Callable[[Any], bool] = lambda method: True
    # checkpoint suffix -> vLLM parameter suffix, where vLLM renames it
    parameter_suffixes: dict[str, str] = field(default_factory=dict)

    def published_quantization_config(self) -> dict[str, Any] | None:
        """A copy of the published ``quantization_config`` (callers edit it)."""
        return copy.deepcopy(self.published_config)


class FormatError(ValueError):
    """A quantization config no known Kimi-K3 format matches; one line."""
