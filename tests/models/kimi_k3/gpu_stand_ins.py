"""Stand-ins for the GPU a CPU test box lacks, where vLLM's Kimi-K3 layers
check for one at construction: MoE kernels' device checks, CUDA streams and
the platform's attention backend. Everything else stays vLLM's own code.
Each stand-in is undone when its context or the test ends."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
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


@functools.cache
def _import_moe_kernel_modules() -> None:
    """Import every module vLLM's MoE kernels live in: fused_moe/experts/ and
    a few fused_moe/*.py, which vLLM's backend oracles import lazily."""
    from vllm.model_executor.layers import fused_moe
    from vllm.model_executor.layers.fused_moe import experts

    for package in (fused_moe, experts):
        for module in pkgutil.iter_modules(package.__path__):
            try:
                importlib.import_module(f"{package.__name__}.{module.name}")
            except Exception:
                continue  # it fails the same way when an oracle imports it


def _moe_kernel_classes() -> set[type]:
    """Every fused-MoE kernel class vLLM ships."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    _import_moe_kernel_modules()
    found: set[type] = set()
    todo = [FusedMoEExperts]
    while todo:
        for subclass in todo.pop().__subclasses__():
            if subclass not in found:
                found.add(subclass)
                todo.append(subclass)
    return found


class _CudaPlatform:
    """vLLM's current platform, answering as the NVIDIA GPU it would run on
    where the unquantized MoE oracle lists its backends by platform: on a CPU
    box the platform is not CUDA and the oracle would list none of them."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_device_capability_family(self, *args: Any, **kwargs: Any) -> bool:
        return False


@contextmanager
def moe_kernels_on_their_gpu() -> Iterator[None]:
    """Let vLLM's own backend selection pick any MoE kernel (``--moe-backend
    NAME``) as it would on a GPU that runs it, though a CPU box has none:
    every kernel's device check (``_supports_current_device``) answers yes,
    the platform reports FP8 support (Triton's FP8 schemes depend on it), and
    the unquantized oracle lists the CUDA backends. What each kernel accepts
    of the layer (its activation, quantization scheme, shapes) is still
    vLLM's own answer."""
    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    from vllm.platforms import current_platform

    with ExitStack() as stack:
        for kernel in _moe_kernel_classes():
            if "_supports_current_device" in kernel.__dict__:
                stack.enter_context(
                    mock.patch.object(
                        kernel,
                        "_supports_current_device",
                        staticmethod(lambda: True),
                    )
                )
        stack.enter_context(
            mock.patch.object(current_platform, "supports_fp8", lambda: True)
        )
        stack.enter_context(
            mock.patch.object(
                unquantized, "current_platform", _CudaPlatform(current_platform)
            )
        )
        yield


class AttentionStandIn(nn.Module):
    """Replaces ``MultiHeadLatentAttention`` in decoder-layer tests: vLLM picks
    an attention backend for the current platform at construction, and the
    unspecified CPU platform has none. The MoE half of the layer is real."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


class CudaStreamStandIn:
    """Replaces ``torch.cuda.Stream`` where a layer creates one at construction
    (the MTP block): a CPU box has no CUDA streams."""
