"""Stand-ins for the GPU a CPU test box lacks, used by the tests only: the
Marlin device check alone, the attention layer of a decoder layer built
without its attention, and a CUDA node of some GPUs at vLLM's checks that
read the local GPUs (``a_cuda_node``: the GPU count ``ParallelConfig``
compares its world size with, the compute capability of vLLM's config
checks). The stand-ins the planner and the selftest share
(every MoE kernel's device check, CUDA streams and events, MLA kernels, the
MoE forward's SiTU op and capture check) are in
``vllm_kimi_k3_moe.tools.meta_rank.stand_ins``. Everything else stays vLLM's own
code. Each stand-in is undone when its context or the test ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from torch import nn

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof.unwritten_memory import (
    RandomUnwrittenMemory,
    UnwrittenMemory,
)


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


@contextmanager
def uninitialised_memory_reads(byte: int) -> Iterator[None]:
    """``torch.empty`` and ``torch.empty_strided`` return tensors whose bytes
    are ``byte``: what a GPU allocation may hold before anything is written
    (a CPU often hands out zeroed pages instead, which would hide a pad
    nobody wrote). The plugin's own mode (``unwritten_memory``), one byte."""
    with UnwrittenMemory(lambda data: data.fill_(byte)):
        yield


@contextmanager
def random_uninitialised_memory(seed: int) -> Iterator[None]:
    """``torch.empty`` and ``torch.empty_strided`` return tensors of random
    bytes (seeded): one constant byte can cancel out in a forward or happen
    to decode as zero in some format; random bytes in a pad show whoever
    reads it."""
    with RandomUnwrittenMemory(seed):
        yield


class CudaNodeView:
    """vLLM's current platform as ``ParallelConfig`` (``vllm.config.parallel``)
    sees it on a CUDA node of ``gpus`` GPUs: CUDA, with that many devices.
    Everything else is the real platform's answer."""

    def __init__(self, platform: Any, gpus: int) -> None:
        self._platform = platform
        self._gpus = gpus

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_cuda(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._gpus


@contextmanager
def a_cuda_node(gpus: int, capability: tuple[int, int]) -> Iterator[None]:
    """vLLM, at its checks that read the local GPUs, sees a CUDA node of
    ``gpus`` GPUs of compute ``capability``: ``ParallelConfig`` compares its
    world size with ``current_platform.device_count()`` on CUDA (and only
    there), and vLLM's config checks ask the platform's
    ``get_device_capability`` (the minimum capability of a quantization
    method, ``VllmConfig._get_quantization_config``); a CPU box answers
    neither (not CUDA, no capability). Nothing else changes: kernels, streams
    and the rest of the platform stay as on the CPU box. What the real ones
    guarantee: the device count of the node the process runs on, the
    capability of its GPU 0."""
    from vllm.config import parallel
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_kimi_k3_moe.patching import replaced_attributes

    def host_gpu(cls: type, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(*capability)

    with (
        replaced_attributes(
            parallel, current_platform=CudaNodeView(current_platform, gpus)
        ),
        replaced_attributes(
            type(current_platform), get_device_capability=classmethod(host_gpu)
        ),
    ):
        yield
