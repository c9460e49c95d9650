"""What each GPU of a topology loads of the routed experts, with the plugin.

Under expert parallelism GPU r of the MoE group (TP x DP GPUs, which vLLM
flattens) holds whole experts as vLLM places them (``Topology.expert_ranges``:
n*r to n*r+n-1 where they split evenly, else the first GPUs one more).
Without it every GPU holds every expert, and of each the intermediate rows
its format's record says (``CheckpointFormat.rank_rows``): an even slice,
or for FP8 block whole 128-row blocks (TP32: GPUs 0-23 one block each,
24-31 none). The test suite holds those rows to what vLLM's loader puts on
each rank. With pipeline stages each stage's GPUs load the experts of its
MoE layers alone, split the same way (``stage_shares``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kimi_k3_moe.tools.check.layout import KimiK3Layout
from vllm_kimi_k3_moe.tools.deployment.topology import Topology, pipeline_layers


@dataclass(frozen=True)
class GpuShare:
    """What one GPU of the MoE group loads: experts [first, end) and, of
    each, intermediate rows [start, end); the checkpoint bytes that is."""

    gpu: int
    experts: tuple[int, int]
    rows: tuple[int, int]
    expert_bytes: int

    @property
    def row_count(self) -> int:
        return self.rows[1] - self.rows[0]


def gpu_shares(
    layout: KimiK3Layout, topology: Topology, expert_bytes: int
) -> list[GpuShare]:
    """Each GPU's share of the routed experts (``expert_bytes`` of them in
    the checkpoint), for the topology ``validate_topology`` let through."""
    experts, intermediate = layout.num_experts, layout.intermediate
    group = topology.moe_group
    if topology.expert_parallel:
        return [
            GpuShare(
                gpu,
                (first, end),
                (0, intermediate),
                expert_bytes * (end - first) // experts,
            )
            for gpu, (first, end) in enumerate(topology.expert_ranges(experts))
        ]
    return [
        GpuShare(
            gpu,
            (0, experts),
            (start, end),
            expert_bytes * (end - start) // intermediate,
        )
        for gpu, (start, end) in enumerate(layout.format.rank_rows(intermediate, group))
    ]


@dataclass(frozen=True)
class StageShare:
    """One pipeline stage: its decoder layers [start, end), the MoE layers
    among them, and what each GPU of the stage's MoE group loads of those."""

    stage: int
    layers: tuple[int, int]
    moe_layers: list[int]
    shares: list[GpuShare]


def stage_shares(
    layout: KimiK3Layout, topology: Topology, expert_bytes: int
) -> list[StageShare]:
    """Each pipeline stage's share: its main-model MoE layers (vLLM's split
    of the decoder layers), split over its GPUs as ``gpu_shares`` splits a
    layer; ``expert_bytes`` (every MoE layer's) counted per layer."""
    per_layer = expert_bytes / len(layout.layers)
    stages = []
    for stage, (start, end) in enumerate(
        pipeline_layers(layout.text_config["num_hidden_layers"], topology.pp_size)
    ):
        moe = [layer for layer in layout.main_layers if start <= layer < end]
        stage_bytes = round(per_layer * len(moe))
        stages.append(
            StageShare(
                stage, (start, end), moe, gpu_shares(layout, topology, stage_bytes)
            )
        )
    return stages


@dataclass(frozen=True)
class ShareRun:
    """Consecutive GPUs first..last holding the same number of rows, GPU r
    from row ``start + count * (r - first)``."""

    first: int
    last: int
    start: int
    count: int
    expert_bytes: int  # each


def row_runs(shares: list[GpuShare]) -> list[ShareRun]:
    """``shares`` (without expert parallelism) as runs of equal slices."""
    runs: list[ShareRun] = []
    for share in shares:
        if runs:
            run = runs[-1]
            next_start = run.start + run.count * (share.gpu - run.first)
            if share.row_count == run.count and (
                share.rows[0] == next_start or run.count == 0
            ):
                runs[-1] = ShareRun(
                    run.first, share.gpu, run.start, run.count, run.expert_bytes
                )
                continue
        runs.append(
            ShareRun(
                share.gpu,
                share.gpu,
                share.rows[0],
                share.row_count,
                share.expert_bytes,
            )
        )
    return runs
