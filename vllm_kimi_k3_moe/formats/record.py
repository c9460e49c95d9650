"""What a Kimi-K3 format is: the record type every format module fills in.

Plain Python: nothing here imports torch or vLLM. The partition rules'
checks call vLLM, importing it only when a layer is being built.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kimi_k3_moe.formats.layouts import ExpertTensors

RoundUp = Callable[[int, int], int]  # (hidden, n) -> the method's own n'
RowRange = tuple[int, int]  # [start, end) of an expert's intermediate rows
RowSplit = Callable[[int, int], list[RowRange]]  # (intermediate, ranks) -> per rank
# (text config, TP size, GPUs sharing each expert) -> why vLLM cannot build
# the format's experts sharded so, in one line, or None
SplitRefusal = Callable[[dict[str, Any], int, int], str | None]

# Partitions are searched in steps of the finest quantization group Kimi-K3
# is published with (NVFP4: 16 values per scale).
SEARCH_STEP = 16


@dataclass(frozen=True)
class PartitionRule:
    """How one quantization method's kernel constrains the per-rank
    partition: ``accepts(method, hidden, n)`` calls the vLLM check that
    enforces it; ``adopt(method)`` does what else the chosen partition needs."""

    name: str  # the vLLM check it calls, for the startup log
    accepts: Callable[[Any, int, int], bool] | None = None
    adopt: Callable[[Any], None] | None = None

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


def config_with_partition(method: Any, n: int) -> Any:
    """A copy of ``method``'s ``FusedMoEConfig`` with a per-rank partition of
    ``n`` rows: vLLM's partition checks read the partition from it."""
    config = copy.copy(method.moe)
    config.intermediate_size_per_partition = n
    config.intermediate_size_per_partition_unpadded = n
    return config


# A method whose ``maybe_roundup_sizes`` already rounds for its kernel.
OWNS_ITS_PADDING = PartitionRule("the method's own maybe_roundup_sizes")


@dataclass(frozen=True)
class QuantizationScheme:
    """What a checkpoint's config files say about its routed experts."""

    quant_method: str | None  # None: no quantization_config (BF16)
    ct_format: str | None = None  # compressed-tensors' "format"
    # the weights of the compressed-tensors group that targets the experts
    expert_weights: dict[str, Any] | None = None
    quant_algo: str | None = None  # ModelOpt's


def even_rows(intermediate: int, ranks: int) -> list[RowRange]:
    """The rows each of ``ranks`` TP ranks loads of every expert: vLLM's
    loader narrows the checkpoint to rank r's logical slice,
    [r*n, (r+1)*n) for n = intermediate // ranks (``_load_w13``/``_load_w2``)."""
    n = intermediate // ranks
    return [(rank * n, (rank + 1) * n) for rank in range(ranks)]


@dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint recognised as one Kimi-K3 format, with its parameters."""

    format: KimiK3Format
    name: str  # as check's summary names it, parameters included
    tensors: ExpertTensors
    # which rows of every expert each TP rank loads, with the plugin, and
    # why they are not an even slice where they are not (check says it)
    row_split: RowSplit = even_rows
    row_split_rule: str = ""

    @property
    def loads_as(self) -> str:
        return self.format.loads_as

    def rank_rows(self, intermediate: int, ranks: int) -> list[RowRange]:
        """[start, end) of the intermediate rows TP rank r of ``ranks``
        loads, for each r (without expert parallelism); start == end: none."""
        return self.row_split(intermediate, ranks)


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
    # Without expert parallelism each rank's logical intermediate rows must
    # be a whole number of this many: the format's scale group along w2's
    # input, so that every rank's scales are its own.
    alignment: int
    alignment_unit: str  # what those are: "MXFP4 scale blocks"
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
    # A sharding of every expert (without expert parallelism) vLLM cannot
    # build for this format beyond whole scale groups (``alignment``)
    split_refusal: SplitRefusal | None = None
    # checkpoint suffix -> vLLM parameter suffix, where vLLM renames it
    parameter_suffixes: dict[str, str] = field(default_factory=dict)

    def published_quantization_config(self) -> dict[str, Any] | None:
        """A copy of the published ``quantization_config`` (callers edit it)."""
        return copy.deepcopy(self.published_config)


class FormatError(ValueError):
    """A quantization config no known Kimi-K3 format matches; one line."""
