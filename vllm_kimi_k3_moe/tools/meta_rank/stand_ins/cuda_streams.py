"""Stands in for CUDA streams and events (``torch.cuda.Stream``, ``Event``).

Why: Kimi-K3's model creates them while it is built, for overlapping work
(``KimiLinearModel``, ``KimiMoE``, the KDA and MLA layers, the latent MoE
runner); a CPU box has no CUDA runtime to create them. What the real ones
guarantee, and the tools do not need: ordering of work on a GPU. The model
is built, never run, under this stand-in; it holds no parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


class CudaStreamStandIn:
    """Replaces ``torch.cuda.Stream`` and ``torch.cuda.Event`` at construction:
    a CPU box has no CUDA runtime to create them. It holds no parameters and
    is never used (the model is built, not run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextmanager
def cuda_streams_and_events() -> Iterator[None]:
    """``torch.cuda.Stream()`` and ``torch.cuda.Event()`` build a stand-in
    (the model creates them in ``KimiLinearModel``, ``KimiMoE``, the KDA and
    MLA layers and the latent MoE runner). Holds no parameters."""
    import torch

    with replaced_attributes(
        torch.cuda, Stream=CudaStreamStandIn, Event=CudaStreamStandIn
    ):
        yield
