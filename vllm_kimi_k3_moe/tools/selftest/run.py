"""One selftest: a layout's ranks against the unsharded experts, judged
against the same kernel unsharded, and next to vLLM alone.

The same kernel at one rank holding every row (TP1, no pads) is run first:
its error is the kernel's own (its activation quantization, BF16 rounding),
and the layout's must stay within twice it (or the path's floor). A layout
with a wrong partition, pad or scale is off by far more (vLLM alone's, in
docs/design.md: 0.96 to 56, or NaN). Then rank 0 is built again with the
plugin taken out of the process (``harness.vllm_alone``), for vLLM alone's
partition and, on a GPU, its time next to the plugin's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import (
    resident,
    rule_of,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
from vllm_kimi_k3_moe.tools.selftest.checkpoint import ExpertCheckpoint
from vllm_kimi_k3_moe.tools.selftest.harness import (
    LoadedRank,
    PreparedLayer,
    SelftestCase,
    SelftestUnusable,
    deployment_outputs,
    errors_of,
    loaded_rank,
    prepare_layer,
    ranks_of,
    vllm_alone,
)
from vllm_kimi_k3_moe.tools.selftest.kernels import KernelPath
from vllm_kimi_k3_moe.tools.selftest.reference import BATCH_SIZES
from vllm_kimi_k3_moe.tools.selftest.shape import MoeShape
from vllm_kimi_k3_moe.tools.selftest.timing import ExpertsTime, experts_times

# The layout's error may be this many times the unsharded kernel's: each
# rank rounds its partial sum, and the ranks' roundings add up.
SHARDING_ALLOWANCE = 2.0


@dataclass(frozen=True)
class RankPartition:
    """What one rank allocated, read from its built layer."""

    rank: Rank
    allocated: int  # intermediate rows per expert
    local_experts: int


@dataclass
class SelftestResult:
    """Everything ``report`` prints."""

    case: SelftestCase
    shape: MoeShape
    device: str  # "cpu" or the GPU's name
    timed: bool  # a GPU kernel's times
    checkpoint: Path | None  # the real checkpoint read, or None (synthetic)
    kernel: str = ""
    partitions: list[RankPartition] = field(default_factory=list)
    rows_loaded: list[tuple[int, int]] = field(default_factory=list)  # per rank
    errors: dict[int, float] = field(default_factory=dict)  # tokens -> error
    unsharded: dict[int, float] = field(default_factory=dict)
    tolerances: dict[int, float] = field(default_factory=dict)
    floor: float = 0.0  # the least of them: the path's arithmetic
    failure: str | None = None  # how the plugin's layout failed to run
    vllm_alone: int | None = None  # vLLM alone's rank-0 partition
    vllm_alone_kept: int | None = None  # what its kernel keeps, where it pads
    vllm_alone_failure: str | None = None
    # tokens -> (plugin's, vLLM alone's) time of rank 0's experts alone
    times: dict[int, tuple[ExpertsTime, ExpertsTime | None]] = field(
        default_factory=dict
    )
    routes_inside: bool = False  # the kernel is monolithic: timed with routing
    interpreted: bool = False  # the GPU's Triton kernel, by Triton's interpreter

    @property
    def ok(self) -> bool:
        return (
            self.failure is None
            and bool(self.errors)
            and all(
                math.isfinite(error) and error <= self.tolerances[tokens]
                for tokens, error in self.errors.items()
            )
        )


def judgeable(layer: PreparedLayer, checkpoint: ExpertCheckpoint) -> None:
    """``SelftestUnusable`` where the checkpoint's experts cannot judge a
    layout: their unsharded output (the reference, from the tensors as
    vLLM's dequantizers read them) is not finite, or all zero (every layout
    sums to zero: expert data all zero; ``prepare_layer`` refuses a layer
    whose bytes are all zero before dequantizing it)."""
    import torch

    expected = layer.expected
    where = f"layer {checkpoint.layer} of {checkpoint.directory}"
    if not torch.isfinite(expected).all():
        raise SelftestUnusable(
            f"the routed experts of {where} give a non-finite output (NaN or "
            "infinite values in their data): a layout cannot be judged on them"
        )
    if not expected.any():
        raise SelftestUnusable(
            f"the routed experts of {where} give an all-zero output (their data "
            "is zero: a header-only or sparse copy?): a layout cannot be judged "
            "on them"
        )


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _times(loaded: LoadedRank, layer: PreparedLayer) -> dict[int, ExpertsTime]:
    """Rank 0's experts alone at each batch size, in a CUDA graph and
    eagerly, inside vLLM's forward context."""
    kernel = loaded.kernel
    assert kernel.experts_alone is not None  # a timed path
    times = {}
    with kernel.context():
        for tokens in BATCH_SIZES:
            times[tokens] = experts_times(
                kernel.experts_alone(*layer.inputs.first(tokens))
            )
    return times


def kept_rows(experts: Any) -> int | None:
    """The rows per expert ``experts``' kernel keeps once its weight
    preparation ran, where it pads the allocated ones again (Marlin, Humming,
    NVFP4 on FlashInfer: ``kernel_rows``); None where it keeps them, or
    no rule of the plugin's knows the method."""
    method, n = experts.quant_method, experts.intermediate_size_per_partition
    try:
        rule = rule_of(method, experts.moe_config)
        kept = None if rule is None else resident(rule, method, n)
    except Exception:  # a method its preparation left unreadable: not known
        return None
    return kept if kept != n else None


def _compare_with_vllm_alone(
    path: KernelPath,
    case: SelftestCase,
    kimi_model: ModuleType,
    layer: PreparedLayer,
    result: SelftestResult,
) -> None:
    """vLLM alone's rank 0: its partition and, on a GPU, its time."""
    try:
        with (
            vllm_alone(kimi_model),
            loaded_rank(
                path, case, kimi_model, layer, ranks_of(case.topology)[0]
            ) as loaded,
        ):
            result.vllm_alone = loaded.experts.intermediate_size_per_partition
            result.vllm_alone_kept = kept_rows(loaded.experts)
            if path.timed:
                alone = _times(loaded, layer)
                result.times = {
                    tokens: (plugin, alone[tokens])
                    for tokens, (plugin, _) in result.times.items()
                }
    except Exception as error:  # what vLLM alone cannot build or run
        result.vllm_alone_failure = _one_line(error)


def run_selftest(
    case: SelftestCase,
    path: KernelPath,
    kimi_model: ModuleType,
    workdir: Path,
    checkpoint: ExpertCheckpoint | None = None,
    device_name: str = "cpu",
) -> SelftestResult:
    """Run ``case`` on ``path`` with the layer's experts from ``checkpoint``
    (None: a synthetic checkpoint in the format), working in ``workdir``.
    ``SelftestUnusable`` if the kernel does not run the format unsharded."""
    layer = prepare_layer(case, path, workdir, checkpoint)
    if checkpoint is not None:
        judgeable(layer, checkpoint)
    result = SelftestResult(
        case,
        layer.shape,
        device_name,
        path.timed,
        checkpoint.directory if checkpoint else None,
        interpreted=getattr(path, "interpreted", False),
    )
    try:
        unsharded = deployment_outputs(path, case, kimi_model, layer, Topology(1))
    except Exception as error:
        raise SelftestUnusable(
            f"vLLM does not run {case.quantization} on --moe-backend "
            f"{case.backend} here ({device_name}), not even unsharded: "
            f"{_one_line(error)}"
        ) from error
    result.unsharded = errors_of(unsharded, layer)
    if not all(math.isfinite(error) for error in result.unsharded.values()):
        raise SelftestUnusable(
            f"the unsharded layer (one rank, every row) is not finite on "
            f"{case.backend} here ({device_name}): a layout cannot be judged"
        )
    result.floor = path.floor
    result.tolerances = {
        tokens: max(path.floor, SHARDING_ALLOWANCE * error)
        for tokens, error in result.unsharded.items()
    }
    if not case.topology.expert_parallel:
        result.rows_loaded = layer.format.rank_rows(
            layer.shape.intermediate, case.topology.moe_group
        )

    def record(rank: Rank, loaded: LoadedRank) -> None:
        experts = loaded.experts
        result.kernel = result.kernel or path.kernel(experts)
        result.partitions.append(
            RankPartition(
                rank, experts.intermediate_size_per_partition, experts.local_num_experts
            )
        )
        if path.timed and len(result.partitions) == 1:
            result.times = {n: (t, None) for n, t in _times(loaded, layer).items()}
            result.routes_inside = loaded.kernel.routes_inside

    try:
        outputs = deployment_outputs(path, case, kimi_model, layer, on_rank=record)
        result.errors = errors_of(outputs, layer)
    except Exception as error:  # a rank the plugin's layout cannot build or run
        result.failure = f"rank {len(result.partitions)}: {_one_line(error)}"
    _compare_with_vllm_alone(path, case, kimi_model, layer, result)
    return result
