"""Fresh allocations that read as random bytes, for the small-layer proof
(``small_layer``): what a GPU's memory may hold before anything is written.

A CPU often hands out zeroed pages and a GPU's caching allocator often hands
back the last tensor's bytes; either can hide a pad nobody wrote. Within the
block, every tensor ``torch.empty`` or ``torch.empty_strided`` returns (on
any device but ``meta``) is filled with random bytes from the block's own
generator: the process's random state is not touched, so seeded sampling and
dummy weights are what they would be without the proof.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# The allocations that leave memory as it was: the methods' create_weights
# allocate with torch.empty; vLLM's layerwise loader materialises with
# torch.empty_strided (reload.meta.materialize_meta_tensor).
_UNWRITTEN = (torch.empty, torch.empty_strided)


class UnwrittenMemory(TorchFunctionMode):
    """Within ``with UnwrittenMemory(fill):`` every fresh allocation (of
    ``_UNWRITTEN``, any device but ``meta``) has its bytes set by ``fill``
    (given them as one flat ``uint8`` tensor). A mode, not a replaced
    ``torch.empty``: torch's device contexts recognise the constructors they
    place by identity, and a replacement seen by the first ``torch.device``
    block of a process stays in torch's cache."""

    def __init__(self, fill: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fill = fill

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if (
            func in _UNWRITTEN
            and isinstance(result, torch.Tensor)
            and not result.is_meta
            and result.numel()
            and result.is_contiguous()
        ):
            with torch.no_grad():
                self.fill(result.view(-1).view(torch.uint8))
        return result


class RandomUnwrittenMemory(UnwrittenMemory):
    """``with RandomUnwrittenMemory(seed):`` fresh allocations read as
    random bytes (seeded, a generator per device)."""

    def __init__(self, seed: int) -> None:
        super().__init__(self._random)
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def _random(self, data: torch.Tensor) -> None:
        if data.device not in self.generators:
            generator = torch.Generator(device=data.device)
            self.generators[data.device] = generator.manual_seed(self.seed)
        data.random_(0, 256, generator=self.generators[data.device])
