"""Stand-ins for the GPU a CPU test box lacks, used by the tests only: the
Marlin device check alone, and the attention layer of a decoder layer built
without its attention. The stand-ins the planner and the selftest share
(every MoE kernel's device check, CUDA streams and events, MLA kernels, the
MoE forward's SiTU op and capture check) are in
``vllm_kimi_k3_moe.tools.build.stand_ins``. Everything else stays vLLM's own
code. Each stand-in is undone when its context or the test ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


@contextmanager
def marlin_without_gpu() -> Iterator[None]:
    """Let vLLM select the Marlin MoE kernel on a machine without CUDA, as
    ``--moe-backend marlin`` does on the GPUs it runs on. Its device check
    (``_supports_current_device``: CUDA, capability 7.5 or above) is the only
    part of the selection that needs a GPU, and a CPU box has none."""
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe

    with mock.patch.object(
        marlin_moe.MarlinExpertsBase,
        "_supports_current_device",
        staticmethod(lambda: True),
    ):
        yield


class AttentionStandIn(nn.Module):
    """Replaces ``MultiHeadLatentAttention`` in decoder-layer tests: vLLM picks
    an attention backend for the current platform at construction, and the
    unspecified CPU platform has none. The MoE half of the layer is real."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


class _FilledEmpty(TorchFunctionMode):
    """Fills every contiguous CPU tensor ``torch.empty`` returns with one byte.
    A mode, not a replaced ``torch.empty``: torch's device contexts recognise
    the constructors they place by identity, and a replacement seen by the
    first ``torch.device`` block of a process stays in torch's cache (a later
    ``torch.device("meta")`` then no longer places ``torch.empty``)."""

    def __init__(self, byte: int) -> None:
        super().__init__()
        self.byte = byte

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if (
            func is torch.empty
            and isinstance(result, Tensor)
            and result.device.type == "cpu"
            and result.dim()
            and result.is_contiguous()
        ):
            result.view(torch.uint8).fill_(self.byte)
        return result


@contextmanager
def uninitialised_memory_reads(byte: int) -> Iterator[None]:
    """``torch.empty`` on the CPU returns tensors whose bytes are ``byte``:
    what a GPU allocation may hold before anything is written (a CPU often
    hands out zeroed pages instead, which would hide a pad nobody wrote)."""
    with _FilledEmpty(byte):
        yield
