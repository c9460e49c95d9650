"""Stand-ins for the GPU a CPU test box lacks, used by the tests only: the
Marlin device check alone, and the attention layer of a decoder layer built
without its attention. The stand-ins the planner shares
(every MoE kernel's device check, CUDA streams and events, MLA kernels) are
in ``vllm_kimi_k3_moe.tools.build.stand_ins``. Everything else stays vLLM's own
code. Each stand-in is undone when its context or the test ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

from torch import nn


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
