"""Time one rank's routed experts on the GPU: warm-up, then the median of
repeated forwards, each between two CUDA events on the current stream."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

WARMUP = 10  # forwards before timing: kernel selection, caches, clocks
REPEATS = 50  # timed forwards; the median is reported


def median_microseconds(
    forward: Callable[[Tensor, Tensor], Tensor], hidden: Tensor, logits: Tensor
) -> float:
    """The median time of ``forward(hidden, logits)`` in microseconds."""
    import torch

    for _ in range(WARMUP):
        forward(hidden, logits)
    times = []
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        forward(hidden, logits)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)  # ms -> us
    return statistics.median(times)
