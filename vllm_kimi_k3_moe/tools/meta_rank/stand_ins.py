"""Stand-ins for what a CPU box lacks when vLLM builds Kimi-K3's layers.

Building vLLM 0.33.0's ``KimiLinearForCausalLM`` on the ``meta`` device (real
shapes, no memory) touches the GPU in a few places that allocate no
parameter: CUDA streams and events (created for overlapping work), the MLA
attention kernel objects (chosen for, and sized to, the GPU the model runs
on), the GPU's compute-unit count, and the device checks by which vLLM picks
an MoE kernel. Each stand-in below replaces one of those for the duration of
a ``with`` block and holds no parameters, so every parameter the model
allocates is vLLM's own; everything it replaces is restored on exit
(``patching.replaced_attributes``). The parallel groups are
``rank.simulated_rank``'s. The planner and the test suite share these (the
suite keeps only stand-ins for parts it replaces whole). The ledger of all
of them is ``vllm_kimi_k3_moe.tools.meta_rank``'s docstring.

``current_platform.num_compute_units()`` (which a CPU platform does not
implement) needs no stand-in: only the MLA kernel objects ask for it, and
they are stood in for here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any

from vllm_kimi_k3_moe.compat import extensible_kv_cache_resolver
from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.topology import Deployment


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


class MlaKernelStandIn:
    """Replaces an MLA attention backend's kernel implementation (its
    ``impl``) and the MLA prefill backend: they hold kernels chosen for the
    GPU (FlashMLA, FlashInfer, CUTLASS MLA, FlashAttention prefill), not
    parameters, and a CPU box can neither select nor import them. It holds
    no parameters. Under decode context parallelism the layer hands vLLM's
    DCP manager the base of the softmax LSE the kernel returns (FlashMLA's:
    natural log)."""

    lse_base_on_e = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@functools.cache
def mla_backend_stand_in() -> type:
    """vLLM's FlashMLA attention backend with ``MlaKernelStandIn`` as its
    ``impl``: what the backend says about the KV cache (kernel block sizes,
    the cache layout, how it customises the MLA spec) is vLLM's own, so the
    KV-cache specs are what a server computes; its kernels are not built.
    FlashMLA runs Kimi-K3's MLA on Hopper and Blackwell; FlashInfer MLA
    (Blackwell's first choice) gives the same block size, as every NVIDIA
    MLA backend's alignment is rounded up to 128 for a hybrid model. The
    FlashAttention MLA backend (Hopper's first choice) does not import on a
    CPU. Holds no parameters."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    class MlaBackendStandIn(FlashMLABackend):
        @staticmethod
        def get_impl_cls() -> type:
            return MlaKernelStandIn

    return MlaBackendStandIn


@contextmanager
def mla_attention_kernels() -> Iterator[None]:
    """Kimi-K3's ``MultiHeadLatentAttention`` gets ``mla_backend_stand_in()``
    from ``get_attn_backend`` and ``MlaKernelStandIn`` as its prefill
    backend, looked up in vLLM's Kimi-K3 ``mla`` module only: the layer's
    projections and norms (its parameters) are vLLM's own. Holds no
    parameters."""
    from vllm.models.kimi_k3.nvidia import mla

    backend = mla_backend_stand_in()
    with replaced_attributes(
        mla,
        get_attn_backend=lambda *args, **kwargs: backend,
        get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
    ):
        yield


@functools.cache
def sparse_mla_backend_stand_in() -> type:
    """vLLM's FlashMLA sparse attention backend with a kernel stand-in as its
    ``impl``, for the sparse (DSA) MLA layers a config with ``dsa_config``
    builds: what the backend says about the KV cache (kernel block sizes,
    its spec customisation, the ``fp8_ds_mla`` format it serves an FP8 KV
    cache in) is vLLM's own; its kernels are not built. FlashMLA sparse runs
    on Hopper and Blackwell and is Hopper's only sparse backend for an FP8
    KV cache; the FlashAttention sparse backend (Hopper's first choice for
    bfloat16) does not import on a CPU. The stand-in kernel says it is
    sparse, has no dense-MHA prefill (so no prefill backend is chosen) and
    gives the ``fp8_ds_mla`` row bytes FlashMLA sparse's implementation
    gives. Holds no parameters."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        FlashMLASparseBackend,
        FlashMLASparseImpl,
    )

    class SparseMlaKernelStandIn(FlashMLASparseImpl):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # vLLM's __new__ reads the rank's DCP and PCP groups

    class SparseMlaBackendStandIn(FlashMLASparseBackend):
        @staticmethod
        def get_impl_cls() -> type:
            return SparseMlaKernelStandIn

    return SparseMlaBackendStandIn


@contextmanager
def sparse_mla_attention_kernels() -> Iterator[None]:
    """vLLM's generic ``MLAAttention`` (which the DSA layers of a config with
    ``dsa_config`` build, through ``MultiHeadLatentAttentionWrapper``) gets
    ``sparse_mla_backend_stand_in()`` where it asks for a sparse backend,
    looked up in vLLM's ``mla_attention`` module only; a dense request gets
    vLLM's own answer. A CPU box's platform has no sparse MLA backend
    ("Invalid attention backend"). The layer's projections, norms and DSA
    indexer (its parameters) are vLLM's own. Holds no parameters."""
    from vllm.model_executor.layers.attention import mla_attention

    own = mla_attention.get_attn_backend
    backend = sparse_mla_backend_stand_in()

    def sparse_on_the_gpu(*args: Any, **kwargs: Any) -> type:
        return backend if kwargs.get("use_sparse") else own(*args, **kwargs)

    with replaced_attributes(
        mla_attention,
        get_attn_backend=sparse_on_the_gpu,
        get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
    ):
        yield


# What vLLM's KDA layer resolves its prefill kernel to on the GPUs Kimi-K3
# runs on: ``resolve_kda_prefill_backend("auto", ...)`` picks FlashKDA on CUDA
# compute capability 9.x, 10.x and 12.x (H20, H200, B200, ...).
GPU_KDA_PREFILL_BACKEND = "flashkda"


def kda_prefill_kernel_of_the_gpu(vllm_config: Any) -> None:
    """Set each built KDA layer's ``kda_prefill_backend`` to what a GPU
    resolves (``GPU_KDA_PREFILL_BACKEND``): a CPU box resolves Triton, and
    the kernel decides how many state blocks a sequence holds in the KV
    cache (FlashKDA keeps a prefill checkpoint block). Building the layer
    with FlashKDA is not possible here: it imports the kernel's CUDA
    library. Holds no parameters; changes no parameter."""
    for layer in vllm_config.compilation_config.static_forward_context.values():
        if hasattr(layer, "kda_prefill_backend"):
            layer.kda_prefill_backend = GPU_KDA_PREFILL_BACKEND


class LinearKernelRegistryPlatform:
    """vLLM's current platform as its linear-kernel registry
    (``vllm.model_executor.kernels.linear``) sees it: the CUDA platform, so
    the registry lists the CUDA kernels for FP8-block and NVFP4 linear
    layers (on a CPU box it lists none, and the layer cannot be built).
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
    """Let vLLM pick the kernel of a quantized linear layer (FP8 block,
    NVFP4) as on the GPU it runs on: the registry lists the CUDA kernels and
    each one's device check (``is_supported``) answers yes; what a kernel
    accepts of the layer (``can_implement``) and the priority order are
    vLLM's. The layer's weights are allocated by its quantization scheme
    before any kernel exists, the same whichever is picked; a kernel object
    holds no parameters."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum, current_platform

    kernels = {
        kernel
        for table in (
            linear._POSSIBLE_FP8_BLOCK_KERNELS,
            linear._POSSIBLE_NVFP4_KERNELS,
        )
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
# for GPUs that are not this host's: a Hopper GPU's, the oldest Kimi-K3 is
# served on (every --gpu preset is 9.0 or later).
SERVING_GPU_CAPABILITY = (9, 0)


@contextmanager
def the_serving_gpus_capability() -> Iterator[None]:
    """While the tools make vLLM's ``ModelConfig`` and ``VllmConfig`` for a
    deployment on GPUs that are not this host's (``plan``, ``check``), the
    platform reports a serving GPU's compute capability
    (``SERVING_GPU_CAPABILITY``), not this host's: ``VllmConfig`` refuses a
    quantization method the current GPU is below the minimum capability of
    (``_get_quantization_config``), and on CUDA ``ModelConfig`` falls back
    from bfloat16 below 8.0 (``CudaPlatform.supported_dtypes``): an older GPU
    on the machine running the tools would refuse, or resize, what the
    serving GPUs run. Every Kimi-K3 format's minimum is 8.0 or less, so
    vLLM's config answers the same for any GPU Kimi-K3 is served on; a CPU
    box's platform has no capability, and vLLM skips the checks there.
    Replaced on the platform's class, where ``has_device_capability`` and
    ``is_device_capability`` ask it too. Holds no parameters."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    capability = DeviceCapability(*SERVING_GPU_CAPABILITY)

    def serving_gpu(cls: type, device_id: int = 0) -> DeviceCapability:
        return capability

    with replaced_attributes(
        type(current_platform), get_device_capability=classmethod(serving_gpu)
    ):
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


@contextmanager
def weightless_model_loader() -> Iterator[None]:
    """``vllm.model_executor.model_loader.get_model`` (and the name
    ``load_eagle_model``'s module imported it under), which vLLM's draft
    loaders (``load_dspark_model``, ``load_eagle_model``) call to build and
    load the draft, builds it as the loader does (``initialize_model`` under
    the draft's config, its dtype the default) on the ``meta`` device and
    loads nothing: the tools have no weights. What the loaders do around it
    (the draft's config, sharing the target's embedding and ``lm_head``) is
    vLLM's. Holds no parameters."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    def build_only(
        *,
        vllm_config: Any,
        model_config: Any = None,
        prefix: str = "",
        load_config: Any = None,
    ) -> Any:
        model_config = model_config or vllm_config.model_config
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(model_config.dtype),
            torch.device("meta"),
        ):
            return initialize_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )

    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    # load_dspark_model imports get_model when called, load_eagle_model (MTP)
    # when its module is imported: both names are replaced
    with (
        replaced_attributes(model_loader, get_model=build_only),
        replaced_attributes(eagle_utils, get_model=build_only),
    ):
        yield


@contextmanager
def whole_model_on_cpu() -> Iterator[None]:
    """The stand-ins the whole model needs, entered together."""
    with ExitStack() as stack:
        stack.enter_context(cuda_streams_and_events())
        stack.enter_context(mla_attention_kernels())
        stack.enter_context(sparse_mla_attention_kernels())
        stack.enter_context(linear_kernels_on_their_gpu())
        stack.enter_context(a_cuda_device())
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


# The compute capability of the GPU the MoE kernels are selected for, where
# one is named (``a_gpu_of_capability``); None: any GPU that runs the kernel.
_SERVING_GPU: ContextVar[tuple[int, int] | None] = ContextVar(
    "serving_gpu", default=None
)
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
    from vllm.platforms.interface import DeviceCapability

    def of_the_gpu(cls: type, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(*capability)

    with replaced_attributes(
        type(current_platform),
        _enum=PlatformEnum.CUDA,
        get_device_capability=classmethod(of_the_gpu),
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


@contextmanager
def a_gpu_of_capability(capability: tuple[int, int]) -> Iterator[None]:
    """While ``moe_kernels_on_their_gpu`` is entered within it, each MoE
    kernel's device check answers as on a GPU of ``capability``
    (``runs_on_capability``; yes where that cannot be told here), so that
    vLLM's own selection picks, or refuses, ``--moe-backend`` as there."""
    token = _SERVING_GPU.set(capability)
    try:
        yield
    finally:
        _SERVING_GPU.reset(token)


def _device_check(kernel: type) -> Any:
    """The device check ``moe_kernels_on_their_gpu`` gives ``kernel``."""
    capability = _SERVING_GPU.get()
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


# --- running vLLM's MoE forward on one machine -------------------------------


def _situ_and_mul_on_cpu(out: Any, input: Any, beta: float, linear_beta: float) -> None:
    """``_C::situ_and_mul`` as vLLM's own ``SituAndMul.forward_native``
    computes it (``linear_beta <= 0`` means unset, as for the CUDA kernel)."""
    from vllm.model_executor.layers.activation import SituAndMul

    # Not SituAndMul(beta, linear_beta): a CustomOp's __init__ wants a current
    # VllmConfig to pick its dispatch; forward_native reads only the betas.
    activation = SituAndMul.__new__(SituAndMul)
    activation.beta = float(beta)
    activation.linear_beta = None if linear_beta <= 0 else float(linear_beta)
    out.copy_(SituAndMul.forward_native(activation, input))


@contextmanager
def situ_and_mul_op_on_cpu() -> Iterator[None]:
    """vLLM's MoE activation (``apply_moe_activation``) calls
    ``torch.ops._C.situ_and_mul``, a CUDA kernel from ``vllm._C``, which a
    CUDA wheel on a CPU box does not load (``No module named 'vllm._C'``).
    The op is defined for the block with a CPU kernel that is vLLM's own
    pure-torch SiTU; the definition is removed again on exit. Holds no
    parameters."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define(
            "situ_and_mul(Tensor! out, Tensor input, float beta, "
            "float linear_beta) -> ()"
        )
        library.impl("situ_and_mul", _situ_and_mul_on_cpu, "CPU")
        yield
    finally:
        library._destroy()


def _compiling_only() -> bool:
    import torch

    return torch.compiler.is_compiling()


@contextmanager
def moe_forward_on_cpu() -> Iterator[None]:
    """What vLLM's batched reference MoE kernel (``NaiveBatchedExperts``, the
    CPU path of ``selftest`` and of the forward-equivalence tests) needs from
    a GPU: the SiTU op (``situ_and_mul_op_on_cpu``), and an answer to
    ``fused_batched_moe._is_capturing_or_compiling``, which asks the CUDA
    driver whether a CUDA graph is being captured
    (``torch.accelerator.current_stream()`` raises without one): nothing is
    captured on a CPU, so only the compile half of the question is asked.
    Neither changes a result; both are put back on exit."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

    with (
        situ_and_mul_op_on_cpu(),
        replaced_attributes(
            fused_batched_moe, _is_capturing_or_compiling=_compiling_only
        ),
    ):
        yield


@contextmanager
def one_gpu_for_the_data_parallel_group(moe_config: Any) -> Iterator[None]:
    """While a rank's MoE kernel is made (``process_weights_after_loading``)
    its ``FusedMoEConfig`` says data-parallel size 1: vLLM then makes the
    local prepare/finalize (``MoEPrepareAndFinalizeNoDPEP*``) instead of the
    all-gather/reduce-scatter over the DP group
    (``all2all_utils.maybe_make_prepare_finalize``), which one GPU posing as
    each rank in turn cannot form. The selftest gives every rank all tokens
    and sums the ranks, which is what the all-gather and reduce-scatter
    compute for one DP rank's tokens. The rank's TP size and rank (vLLM
    flattens them over DP), its EP size and rank and its expert map are left
    as built; the default all-to-all backend (``allgather_reducescatter``)
    makes the same experts kernel either way. Without DP, nothing changes.
    Holds no parameters."""
    parallel = moe_config.moe_parallel_config
    if parallel.dp_size == 1:
        yield
        return
    local = dataclasses.replace(parallel, dp_size=1, dp_rank=0)
    with replaced_attributes(moe_config, moe_parallel_config=local):
        yield


# --- vLLM's Triton MoE kernel run by Triton's interpreter on the CPU ---------

# The GPU whose tuned Triton MoE configs the interpreted kernel is launched
# with (vLLM's file-name form of ``torch.cuda.get_device_name``).
TRITON_CONFIG_GPU = "NVIDIA_H100_80GB_HBM3"


def _moe_align_block_size_on_cpu(
    topk_ids: Any,
    num_experts: int,
    block_size: int,
    sorted_token_ids: Any,
    expert_ids: Any,
    num_tokens_post_pad: Any,
    expert_map: Any = None,
    scatter_idx: Any = None,
) -> None:
    """``_moe_C::moe_align_block_size`` (csrc/moe/moe_align_sum_kernels.cu),
    as ``moe_align_block_size.moe_align_block_size`` documents it: the
    routed slots (``topk_ids`` flattened) grouped by expert in slot order,
    each expert's run padded with the sentinel ``topk_ids.numel()`` to a
    multiple of ``block_size``; one expert id per block; the padded total.
    Given ``expert_map`` (``ignore_invalid_experts``), slots of experts not
    on this rank are left out and blocks carry local ids. It computes
    indices, not values: the kernel reads the tokens it names."""
    import torch

    flat = topk_ids.flatten().long()
    sentinel = flat.numel()
    experts = flat if expert_map is None else expert_map.long()[flat]
    sorted_token_ids.fill_(sentinel)
    expert_ids.fill_(-1)
    position = block = 0
    for expert in range(num_experts if expert_map is None else int(experts.max()) + 1):
        slots = (experts == expert).nonzero().flatten()
        if slots.numel() == 0:
            continue
        padded = -(-slots.numel() // block_size) * block_size
        sorted_token_ids[position : position + slots.numel()] = slots.to(torch.int32)
        expert_ids[block : block + padded // block_size] = expert
        position, block = position + padded, block + padded // block_size
    num_tokens_post_pad.fill_(position)
    if scatter_idx is not None:
        scatter_idx.copy_(
            torch.where(experts >= 0, torch.arange(sentinel), -1)[:, None]
        )


def _moe_sum_on_cpu(
    input: Any, output: Any, topk_ids: Any = None, expert_map: Any = None
) -> None:
    """``_moe_C::moe_sum``: each token's top-k rows summed into ``output``;
    with ``expert_map``, the slots of experts not on this rank left out."""
    if expert_map is not None:
        held = (expert_map[topk_ids.long()] >= 0).to(input.dtype)[..., None]
        input = input * held
    output.copy_(input.sum(dim=1))


def _dynamic_per_token_scaled_fp8_quant_on_cpu(
    out: Any, input: Any, scale: Any, scale_ub: Any = None
) -> None:
    """``_C::dynamic_per_token_scaled_fp8_quant`` as vLLM's own
    ``QuantFP8.forward_native`` computes it for dynamic per-token scales."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    quant = QuantFP8(
        static=False, group_shape=GroupShape.PER_TOKEN, compile_native=False
    )
    values, scales = quant.forward_native(input, scale_ub=scale_ub)
    out.copy_(values)
    scale.copy_(scales)


# Triton's float types the interpreter's narrowing casts are redone for, as
# torch's dtype names (``_narrowing_float_cast``).
_TORCH_FLOATS = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8e4nv": "float8_e4m3fn",
    "fp8e5": "float8_e5m2",
}


def _narrowing_float_cast(own: Any) -> Any:
    """Triton's interpreter's ``_convert_float`` (a float cast in numpy, bit
    by bit), but narrowing casts rounded to nearest even as a GPU's
    ``cvt.rn`` rounds them, by torch's cast. The interpreter's own (Triton
    3.8) loses the carry when rounding up overflows the mantissa: FP32 7.9
    to FP8 e4m3 gives 4 (a GPU: 8), 127 gives 64, 31 gives 16; so vLLM's
    Triton activation quantization (``per_token_group_quant_fp8``),
    interpreted, would hand the MoE GEMM values off by half. Every other
    cast (widening, integers, round-toward-zero) stays the interpreter's."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    @functools.wraps(own)
    def convert(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any):
        source = _TORCH_FLOATS.get(input_dtype.name)
        target = _TORCH_FLOATS.get(output_dtype.name)
        narrowing = input_dtype.primitive_bitwidth > output_dtype.primitive_bitwidth
        nearest = rounding_mode in (None, interpreter._ir.ROUNDING_MODE.RTNE)
        if not (source and target and narrowing and nearest):
            return own(input, input_dtype, output_dtype, rounding_mode)
        values = torch.frombuffer(
            bytearray(input.tobytes()), dtype=getattr(torch, source)
        )
        bits = output_dtype.primitive_bitwidth
        cast = values.to(getattr(torch, target)).view(getattr(torch, f"int{bits}"))
        unsigned = getattr(np, f"uint{bits}")
        return cast.numpy().view(unsigned).reshape(input.shape)

    return convert


@contextmanager
def triton_moe_forward_on_cpu() -> Iterator[None]:
    """What vLLM's Triton MoE path (``TritonExperts``: ``fused_moe_kernel``
    and the Triton activation quantization, run by Triton's interpreter)
    calls besides Triton, from ``vllm._C`` / ``vllm._moe_C``, which a CUDA
    wheel on a CPU box does not load: the routed slots' alignment to the
    kernel's blocks, the top-k sum, the SiTU op (``situ_and_mul_op_on_cpu``)
    and per-token FP8 activation quantization. Each is defined for the
    block with a CPU kernel (vLLM's own Python where it has one:
    ``SituAndMul.forward_native``, ``QuantFP8.forward_native``) and removed
    again on exit; none is defined where the op exists. And the name of
    the GPU, by which the kernel's launch config (tile sizes) is looked up
    (``get_config_file_name``): an H100's (``TRITON_CONFIG_GPU``), where a
    CPU's platform has none. And, for the interpreter itself, its narrowing
    float casts rounded as a GPU rounds them (``_narrowing_float_cast``).
    Hold no parameters."""
    import torch
    from triton.runtime import interpreter
    from vllm.model_executor.layers.fused_moe import fused_moe

    with ExitStack() as stack:
        stack.enter_context(situ_and_mul_op_on_cpu())
        stack.enter_context(
            replaced_attributes(
                interpreter,
                _convert_float=_narrowing_float_cast(interpreter._convert_float),
            )
        )
        stack.enter_context(
            replaced_attributes(
                fused_moe, get_device_name_as_file_name=lambda: TRITON_CONFIG_GPU
            )
        )
        for namespace, name, schema, kernel in (
            (
                "_moe_C",
                "moe_align_block_size",
                "(Tensor topk_ids, int num_experts, int block_size, "
                "Tensor! sorted_token_ids, Tensor! experts_ids, "
                "Tensor! num_tokens_post_pad, Tensor? expert_map=None, "
                "Tensor!? scatter_idx=None) -> ()",
                _moe_align_block_size_on_cpu,
            ),
            (
                "_moe_C",
                "moe_sum",
                "(Tensor input, Tensor! output, Tensor? topk_ids=None, "
                "Tensor? expert_map=None) -> ()",
                _moe_sum_on_cpu,
            ),
            (
                "_C",
                "dynamic_per_token_scaled_fp8_quant",
                "(Tensor! result, Tensor input, Tensor! scale, "
                "Tensor? scale_ub=None) -> ()",
                _dynamic_per_token_scaled_fp8_quant_on_cpu,
            ),
        ):
            if hasattr(getattr(torch.ops, namespace), name):
                continue
            library = torch.library.Library(namespace, "FRAGMENT")
            stack.callback(library._destroy)
            library.define(name + schema)
            library.impl(name, kernel, "CPU")
        yield


@contextmanager
def vllm_without_its_package_initialiser() -> Iterator[None]:
    """Import ``vllm``'s submodules (``vllm.plugins``, ``vllm.version``,
    ``vllm.platforms``) without running ``vllm/__init__.py`` first: the
    package module is made from its spec but not executed. Why: that file
    imports ``vllm.env_override``, which imports torch and its compiler
    (inductor, dynamo: 5-10 s idle, more on a loaded host) to set compiler
    options, none of which vLLM's plugin loader reads (``vllm.plugins``
    imports only ``vllm.envs``, which is the standard library). ``doctor``
    asks the loader through it. On exit every ``vllm`` module imported
    inside is forgotten, so a later ``import vllm`` runs the real
    initialiser; where vLLM is imported already, nothing is replaced.
    Re-check: ``vllm/plugins/__init__.py``'s imports."""
    if "vllm" in sys.modules:
        yield
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
    sys.modules["vllm"] = importlib.util.module_from_spec(spec)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
