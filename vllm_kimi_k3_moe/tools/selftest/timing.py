"""Time one rank's routed experts on the GPU, as vLLM runs them when decoding.

vLLM's model runner replays CUDA graphs for the batch sizes it captures
(decode), so the experts kernel runs without Python between its launches;
timed eagerly, the casts, the router and Python's launch gaps of a few
microseconds each weigh as much as a small batch's kernel, and the plugin's
partition and vLLM alone's read about the same. ``experts_times`` times a
call that runs the experts alone (``kernels.RankKernel.experts_alone``: the
router's choice made before), captured in a CUDA graph and replayed, and
the same call eagerly beside it: the median of ``REPEATS`` after ``WARMUP``,
each between two CUDA events on the current stream.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WARMUP = 10  # calls before timing: kernel selection, caches, clocks
REPEATS = 50  # timed calls (or graph replays); the median is reported


@dataclass(frozen=True)
class ExpertsTime:
    """Median microseconds of the experts alone: replayed from a CUDA graph
    (None, and why, where the kernel cannot be captured) and eager."""

    graph: float | None
    eager: float
    not_captured: str | None = None


def median_microseconds(run: Callable[[], Any]) -> float:
    """The median time of ``run()`` in microseconds, after warm-up."""
    import torch

    for _ in range(WARMUP):
        run()
    times = []
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)  # ms -> us
    return statistics.median(times)


def captured(run: Callable[[], Any]) -> Callable[[], Any]:
    """``run`` captured in a CUDA graph, as vLLM captures a forward: warmed
    up on a side stream first (the kernel's workspaces are made then), then
    recorded once; the graph's ``replay``."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def experts_times(run: Callable[[], Any]) -> ExpertsTime:
    """``run`` (the experts alone) timed replayed from a CUDA graph and
    eagerly."""
    eager = median_microseconds(run)
    try:
        replay = captured(run)
    except RuntimeError as error:  # a kernel that cannot be captured
        return ExpertsTime(None, eager, str(error).splitlines()[0])
    return ExpertsTime(median_microseconds(replay), eager)
