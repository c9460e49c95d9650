"""Stands in for the CUDA platform's answers while the tools make vLLM's
configs and build the model: a current device, a device type for ``vllm
serve``'s parser, the serving GPU's compute capability, and the CUDA
platform's support for the hybrid KV-cache manager, CUDA graph capture and
the extensible KV cache.

Why: the tools run on a host that is not the serving GPU (a CPU box, or an
older GPU), and vLLM's config rules ask the current platform. What the real
platform guarantees and each stand-in reproduces is said at each one: vLLM's
own rules then size what they size as on the serving GPUs. Each is replaced
for a ``with`` block only and holds no parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from vllm_kimi_k3_moe.compat import extensible_kv_cache_resolver
from vllm_kimi_k3_moe.patching import replaced_attributes


@contextmanager
def a_cuda_device() -> Iterator[None]:
    """``current_platform.current_device()`` answers ``cuda:0``:
    ``KimiK3ForConditionalGeneration`` asks for it to move its vision tower
    there, which it skips for a module on ``meta``; a CPU box's platform has
    no current device. Holds no parameters."""
    import torch
    from vllm.platforms import current_platform

    with replaced_attributes(
        current_platform, current_device=lambda: torch.device("cuda", 0)
    ):
        yield


@contextmanager
def a_cuda_platform_for_the_parser() -> Iterator[None]:
    """vLLM's argument parser (``EngineArgs.add_cli_args``, which ``vllm
    serve``'s adds to its own) builds each config class's defaults, and
    ``DeviceConfig``'s "auto" asks the current platform for its device type,
    which a CPU box's unspecified platform does not have: here it says
    ``cuda``, as on the GPUs a serve command is for. Holds no parameters."""
    from vllm.platforms import current_platform

    with replaced_attributes(current_platform, device_type="cuda"):
        yield


# The compute capability vLLM's config checks see when the tools make a config
# for GPUs that are not this host's and none is named: a Hopper GPU's, the
# oldest Kimi-K3 is served on (every --gpu preset is 9.0 or later).
SERVING_GPU_CAPABILITY = (9, 0)

# The compute capability of the GPUs a plan is for, where ``--gpu NAME`` names
# them (``a_gpu_of_capability``); None: not named.
_NAMED_GPU: ContextVar[tuple[int, int] | None] = ContextVar("named_gpu", default=None)


def named_gpu_capability() -> tuple[int, int] | None:
    """The compute capability ``a_gpu_of_capability`` holds, if entered."""
    return _NAMED_GPU.get()


@contextmanager
def platform_reports(capability: tuple[int, int]) -> Iterator[None]:
    """The current platform's ``get_device_capability`` answers
    ``capability``; replaced on the platform's class, where
    ``has_device_capability``, ``is_device_capability`` and
    ``is_device_capability_family`` ask it too. Nothing else of the platform
    changes."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    answer = DeviceCapability(*capability)

    def serving_gpu(cls: type, device_id: int = 0) -> DeviceCapability:
        return answer

    with replaced_attributes(
        type(current_platform), get_device_capability=classmethod(serving_gpu)
    ):
        yield


@contextmanager
def a_gpu_of_capability(capability: tuple[int, int] | None) -> Iterator[None]:
    """While entered, vLLM builds as on a GPU of ``capability`` (None: no
    GPU named, nothing replaced), the GPU
    ``plan --gpu NAME`` is for: its questions about the current GPU, when
    it makes the configs and when it builds the model, answer so (a method
    that asks for a GPU generation when it is built, vLLM's online
    ``nvfp4_per_token``: Blackwell, is built or refused as there; on a CPU
    box the platform has no capability and every such check says no), and
    within ``moe_kernels.moe_kernels_on_their_gpu`` each MoE kernel's device
    check answers as there (``runs_on_capability``; yes where that cannot be
    told here), so that vLLM's own selection picks, or refuses,
    ``--moe-backend`` as there. Holds no parameters."""
    if capability is None:
        yield
        return
    token = _NAMED_GPU.set(capability)
    try:
        with platform_reports(capability):
            yield
    finally:
        _NAMED_GPU.reset(token)


@contextmanager
def the_serving_gpus_capability() -> Iterator[None]:
    """While the tools make vLLM's ``ModelConfig`` and ``VllmConfig`` for a
    deployment on GPUs that are not this host's (``plan``, ``check``), the
    platform reports the serving GPUs' compute capability: the named GPU's
    (``a_gpu_of_capability``), else ``SERVING_GPU_CAPABILITY``, not this host's:
    ``VllmConfig`` refuses a quantization method the current GPU is below
    the minimum capability of (``_get_quantization_config``), and on CUDA
    ``ModelConfig`` falls back from bfloat16 below 8.0
    (``CudaPlatform.supported_dtypes``): an older GPU on the machine running
    the tools would refuse, or resize, what the serving GPUs run. Every
    Kimi-K3 format's minimum is 8.0 or less, so vLLM's config answers the
    same for any GPU Kimi-K3 is served on; a CPU box's platform has no
    capability, and vLLM skips the checks there. Holds no parameters."""
    with platform_reports(_NAMED_GPU.get() or SERVING_GPU_CAPABILITY):
        yield


def _hybrid_kv_cache(cls: type) -> bool:
    return True


@contextmanager
def cuda_hybrid_kv_cache() -> Iterator[None]:
    """The platform supports vLLM's hybrid KV-cache manager, as
    ``CudaPlatform.support_hybrid_kv_cache`` does (Kimi-K3's MLA and KDA
    layers are grouped by it); a CPU box's platform does not, and
    ``VllmConfig`` would turn it off, or refuse a config (a draft's, made with
    ``vllm.config.replace``) that has it on. Holds no parameters."""
    from vllm.platforms import current_platform

    with replaced_attributes(
        type(current_platform), support_hybrid_kv_cache=classmethod(_hybrid_kv_cache)
    ):
        yield


def _static_graph_mode(cls: type) -> bool:
    return True


@contextmanager
def cuda_graph_capture_sizes() -> Iterator[None]:
    """The platform captures CUDA graphs, as ``CudaPlatform``'s
    ``support_static_graph_mode`` says: ``VllmConfig`` then sizes the capture
    range with its own rules (``_set_cudagraph_sizes``). A CPU box's platform
    captures none and leaves ``max_cudagraph_capture_size`` None, which every
    MoE layer hands its kernel (``FusedMoEConfig.max_capture_size``), and a
    kernel that compares it with 0 fails (vLLM 0.34's
    ``FlashInferCuteDSLExperts``). Holds no parameters."""
    from vllm.platforms import current_platform

    with replaced_attributes(
        type(current_platform),
        support_static_graph_mode=classmethod(_static_graph_mode),
    ):
        yield


def _cuda_alike() -> bool:
    return True


def _not_rocm() -> bool:
    return False


@contextmanager
def cuda_extensible_kv_cache() -> Iterator[None]:
    """While ``VllmConfig`` settles whether the KV cache is extensible (the
    method ``compat.extensible_kv_cache_resolver`` names; vLLM 0.33 has none,
    and nothing is replaced), the current platform answers as CUDA does
    (``is_cuda_alike``, not ROCm): vLLM then turns it on as on the serving
    GPUs, and resolves ``gpu_memory_utilization`` and the KV-cache sizing
    as there. A CPU box's platform does not support it, and vLLM would size
    the KV cache as it does without it. The rest of the config is made with
    the real platform's answers. Holds no parameters."""

    name = extensible_kv_cache_resolver()
    if name is None:
        yield
        return
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    own = getattr(VllmConfig, name)

    def as_on_cuda(self: Any) -> None:
        with replaced_attributes(
            current_platform, is_cuda_alike=_cuda_alike, is_rocm=_not_rocm
        ):
            own(self)

    with replaced_attributes(VllmConfig, **{name: as_on_cuda}):
        yield
