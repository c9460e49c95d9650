"""Stands in for the GPU vLLM's linear-kernel registry asks about, for every
quantized linear layer (each ``_POSSIBLE_*_KERNELS`` table of the registry:
FP8 per block, per tensor and per token, NVFP4, MXFP8, INT8, W4A16, ...;
an online method such as ``fp8_per_channel`` quantizes the linear layers
too).

Why: on a CPU box the registry (``vllm.model_executor.kernels.linear``)
lists no kernel for them and the layer cannot be built. What the real
registry guarantees and still decides here: what a kernel accepts of the
layer (``can_implement``) and the priority order; only each CUDA kernel's
device check (``is_supported``) answers yes. The layer's weights are
allocated by its quantization scheme before any kernel exists, the same
whichever is picked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


class LinearKernelRegistryPlatform:
    """vLLM's current platform as its linear-kernel registry
    (``vllm.model_executor.kernels.linear``) sees it: the CUDA platform, so
    the registry lists the CUDA kernels for quantized linear layers (on a
    CPU box it lists none, and the layer cannot be built).
    Everything else is the real platform's answer. Holds no parameters."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    @property
    def _enum(self) -> Any:
        from vllm.platforms import PlatformEnum

        return PlatformEnum.CUDA


def _supported(cls: type, compute_capability: Any = None) -> tuple[bool, None]:
    return True, None


@contextmanager
def linear_kernels_on_their_gpu() -> Iterator[None]:
    """Let vLLM pick the kernel of a quantized linear layer (any of the
    registry's tables) as on the GPU it runs on: the registry lists the CUDA kernels and
    each one's device check (``is_supported``) answers yes; what a kernel
    accepts of the layer (``can_implement``) and the priority order are
    vLLM's. The layer's weights are allocated by its quantization scheme
    before any kernel exists, the same whichever is picked; a kernel object
    holds no parameters."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum, current_platform

    kernels = {
        kernel
        for name, table in vars(linear).items()
        if name.startswith("_POSSIBLE_") and name.endswith("KERNELS")
        for kernel in table.get(PlatformEnum.CUDA, [])
    }
    with ExitStack() as stack:
        stack.enter_context(
            replaced_attributes(
                linear, current_platform=LinearKernelRegistryPlatform(current_platform)
            )
        )
        for kernel in kernels:
            stack.enter_context(
                replaced_attributes(kernel, is_supported=classmethod(_supported))
            )
        yield
