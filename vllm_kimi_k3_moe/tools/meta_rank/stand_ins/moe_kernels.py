"""Stands in for the GPU vLLM's MoE kernel selection asks about: each MoE
kernel's device check, FP8 support, the platform the unquantized oracle and
AutoAWQ's fallback read.

Why: vLLM picks the kernel ``--moe-backend`` names by asking the device, and
a CPU box runs none of them. What the real selection guarantees and still
decides here: which kernel ``--moe-backend`` names and what each kernel
accepts of the layer (activation, quantization scheme, shapes); the device
checks answer as on a GPU that runs the kernel, or, within
``cuda_platform.a_gpu_of_capability``, as on a GPU of that compute
capability (vLLM's own check, run against that capability).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.cuda_platform import (
    named_gpu_capability,
    platform_reports,
)


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


class CudaPlatformStandIn:
    """vLLM's current platform, answering as the NVIDIA GPU it would run on
    where the unquantized MoE oracle lists its backends by platform: on a CPU
    box the platform is not CUDA and the oracle would list none of them.
    Everything else is the real platform's answer. Holds no parameters."""

    def __init__(self, platform: Any, capability: tuple[int, int] | None = None):
        self._platform = platform
        self._capability = capability

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_device_capability_family(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def get_device_capability(self, *args: Any, **kwargs: Any) -> Any:
        if self._capability is None:
            return self._platform.get_device_capability(*args, **kwargs)
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(*self._capability)


# The compute capability of a Hopper GPU (H100, H200, H20): where the
# AutoAWQ fallback kernel (``MoeWNA16Config``) asks for one, it is enough.
HOPPER = (9, 0)


def _yes() -> bool:
    return True


# GPU generations asked to tell a device check that reads the GPU's compute
# capability from one that asks for what this machine lacks (a compiled op,
# a kernel library): Hopper, Blackwell (B200, B300), Blackwell workstation.
_GENERATIONS = ((9, 0), (10, 0), (10, 3), (12, 0))


@contextmanager
def _platform_of_capability(capability: tuple[int, int]) -> Iterator[None]:
    """vLLM's current platform as a CUDA GPU of ``capability`` (its class's
    ``_enum`` and ``get_device_capability``, which ``is_cuda``,
    ``has_device_capability``, ``is_device_capability`` and
    ``is_device_capability_family`` read): only while a kernel's device
    check runs, never while a layer is built."""
    from vllm.platforms import PlatformEnum, current_platform

    with (
        replaced_attributes(type(current_platform), _enum=PlatformEnum.CUDA),
        platform_reports(capability),
    ):
        yield


def runs_on_capability(kernel: type, capability: tuple[int, int]) -> bool | None:
    """vLLM's own device check of an MoE ``kernel``
    (``_supports_current_device``) on a GPU of ``capability``; None where it
    says no on every GPU generation: it asks for what this machine lacks,
    not for a GPU, and cannot be answered here."""

    def answer(of: tuple[int, int]) -> bool:
        with _platform_of_capability(of):
            try:
                return bool(kernel._supports_current_device())
            except Exception:  # an abstract base's, or a library's failure
                return False

    if answer(capability):
        return True
    if not any(answer(other) for other in _GENERATIONS if other != capability):
        return None
    return False


def _device_check(kernel: type) -> Any:
    """The device check ``moe_kernels_on_their_gpu`` gives ``kernel``."""
    capability = named_gpu_capability()
    if capability is None:
        return staticmethod(_yes)
    runs = runs_on_capability(kernel, capability) is not False
    return staticmethod(lambda: runs)


@contextmanager
def moe_kernels_on_their_gpu() -> Iterator[None]:
    """Let vLLM's own backend selection pick any MoE kernel (``--moe-backend
    NAME``) as it would on a GPU that runs it, though a CPU box has none:
    every kernel's device check (``_supports_current_device``) answers yes
    (within ``a_gpu_of_capability``: as on that GPU),
    the platform reports FP8 support (Triton's FP8 schemes depend on it), and
    the unquantized oracle lists the CUDA backends. What each kernel accepts
    of the layer (its activation, quantization scheme, shapes) is still
    vLLM's own answer. AutoAWQ's fallback (``MoeWNA16Config``) asks for the
    GPU's compute capability: a Hopper's. Holds no parameters."""
    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    from vllm.model_executor.layers.quantization import moe_wna16
    from vllm.platforms import current_platform

    with ExitStack() as stack:
        # hasattr: some kernels inherit the check from a base that is not a
        # FusedMoEExperts (the TRT-LLM ones); replaced_attributes deletes it
        # again on exit, so they inherit it again.
        # every answer first: a kernel may inherit its base's check
        checks = {
            kernel: _device_check(kernel)
            for kernel in _moe_kernel_classes()
            if hasattr(kernel, "_supports_current_device")
        }
        for kernel, check in checks.items():
            stack.enter_context(
                replaced_attributes(kernel, _supports_current_device=check)
            )
        stack.enter_context(replaced_attributes(current_platform, supports_fp8=_yes))
        stack.enter_context(
            replaced_attributes(
                unquantized, current_platform=CudaPlatformStandIn(current_platform)
            )
        )
        hopper = CudaPlatformStandIn(current_platform, HOPPER)
        stack.enter_context(replaced_attributes(moe_wna16, current_platform=hopper))
        yield


@contextmanager
def compressed_tensors_mxfp4_kernel(backend: str) -> Iterator[None]:
    """vLLM's compressed-tensors MXFP4 method runs CUTLASS where the GPU
    supports it (``CutlassExpertsMxfp4._supports_current_device``) and
    Marlin elsewhere, whatever ``--moe-backend`` says: its device check
    answers as the GPU ``backend`` names would (``cutlass``: a Blackwell
    GPU; ``marlin``: one without CUTLASS MXFP4)."""
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import (
        CutlassExpertsMxfp4,
    )

    cutlass = backend == "cutlass"
    with (
        moe_kernels_on_their_gpu(),
        replaced_attributes(
            CutlassExpertsMxfp4, _supports_current_device=staticmethod(lambda: cutlass)
        ),
    ):
        yield


def moe_kernel_of_the_gpu(deployment: Deployment) -> Any:
    """The MoE kernel ``deployment`` names (``--moe-backend``), chosen by
    vLLM's own selection with every kernel's device check answering as on
    the GPU that runs it (``moe_kernels_on_their_gpu``); for
    compressed-tensors MXFP4, which picks its kernel from the GPU alone, the
    GPU it names (``compressed_tensors_mxfp4_kernel``)."""
    if deployment.quantization == mxfp4.COMPRESSED_TENSORS.name:
        return compressed_tensors_mxfp4_kernel(deployment.backend)
    return moe_kernels_on_their_gpu()
