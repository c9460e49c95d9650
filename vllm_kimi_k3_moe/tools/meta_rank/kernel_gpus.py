"""Which MoE kernels run on which GPU, and what a kernel needs of the line.

A ``--moe-backend`` runs on a GPU where vLLM's own selection picks a kernel
for it there: the Kimi-K3 MoE layer is built (two layers, on ``meta``) as
plan builds it, with every kernel's device check
(``_supports_current_device``) answering as on a GPU of that compute
capability (``stand_ins.a_gpu_of_capability``); where vLLM's selection
then refuses the backend, its refusal is the reason. The GPU presets'
compute capabilities: Hopper (H100, H200, H20) is 9.0, Blackwell B200 and
GB200 10.0, B300 and GB300 10.3 (vLLM's ``flashinfer_moe_ep``
``_SUPPORTED_CAPABILITIES`` and its MXFP8 linear kernel, "sm_100/sm_103
(Blackwell)", name the two Blackwell datacenter ones).

On an AMD GPU (``gpus.an_amd_gpu_named``) the layer is vLLM's AMD
``KimiMoE``, built under ROCm's platform stand-in, whose kernels answer
their own device checks; the ``--moe-backend`` names are ROCm's
(``gpus.AMD_MOE_BACKENDS``), and plan's default there is what vLLM selects
with ``--moe-backend auto`` (``backend_vllm_selects_on_amd``).

What a kernel needs of the serve line beyond its name: FlashInfer's TRT-LLM
MXFP4 MoE kernel allocates about 1.6 GiB outside vLLM's memory pool on its
first forward, which vLLM's Kimi-K3 recipe leaves free by running it at
``--gpu-memory-utilization 0.90`` (``KERNEL_UTILIZATION``).
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.formats import FORMATS, format_named
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    AITER_VARIABLE,
    XPU,
    amd_moe_backends,
    an_amd_gpu_named,
    named_aiter,
    named_amd_arch,
)
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    main_moe_layers,
    one_layer_of_each,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Serving,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    SERVING_GPU_CAPABILITY,
    a_gpu_of_capability,
    runs_on_capability,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import (
    BUILD_ERRORS,
    amd_kimi_moe_module,
    build_rank,
)

GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "h100": (9, 0),
    "h20": (9, 0),
    "h200": (9, 0),
    "b200": (10, 0),
    "gb200": (10, 0),
    "b300": (10, 3),
    "gb300": (10, 3),
}

# (format, --moe-backend) -> the --gpu-memory-utilization its line carries
# unless one is given: the share vLLM's recipe runs the kernel at, leaving
# free what it allocates outside vLLM's pool.
KERNEL_UTILIZATION: dict[tuple[str, str], float] = {
    ("mxfp4", "flashinfer_trtllm"): 0.90,
}


def kernel_utilization(quantization: str, backend: str) -> float | None:
    """The ``--gpu-memory-utilization`` the kernel needs, or None (vLLM's)."""
    return KERNEL_UTILIZATION.get((quantization, backend))


@dataclass(frozen=True)
class KernelOnGpu:
    """vLLM's selection for ``--moe-backend`` on one GPU."""

    backend: str
    kernel: str | None  # the experts class vLLM picked; None: refused
    refusal: str | None = None  # vLLM's reason, one line
    # False: the picked kernel's device check asks for what this machine
    # lacks (a kernel library, a compiled op), so whether it runs on the
    # GPU is not known here (it was let through)
    verified: bool = True

    @property
    def runs(self) -> bool:
        return self.kernel is not None


def _routed_method(
    text_config: dict[str, Any],
    deployment: Deployment,
    capability: tuple[int, int] | None,
    quantization_config: dict[str, Any] | None,
) -> Any:
    """The routed experts' quantization method vLLM builds for
    ``deployment`` as plan builds it (one dense and one MoE layer of
    ``text_config``, the plugin registered) on a GPU of ``capability``, or
    vLLM's refusal (one line)."""
    vllm_kimi_k3_moe.register()
    model = (
        amd_kimi_moe_module()
        if named_amd_arch() is not None
        else importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    )
    # one stage: pipeline stages change which layers a GPU holds, not the
    # kernel, and the MoE layer of the two built must be rank 0's
    deployment = replace(deployment, pp_size=1)
    layers = one_layer_of_each(text_config)
    config = quantization_config or deployment.format.published_quantization_config()
    serving = Serving(language_model_only=True)
    with tempfile.TemporaryDirectory(prefix="kimi-k3-kernel-") as directory:
        model_dir = write_model_dir(layers, config, serving, Path(directory))
        try:
            with a_gpu_of_capability(capability):
                built = build_rank(
                    model.KimiMoE, layers, deployment, serving, model_dir
                )
        except BUILD_ERRORS as error:
            return " ".join(f"{type(error).__name__}: {error}".split())
        except ImportError as error:
            if named_amd_arch() is None:
                raise
            # XPU's own experts import vllm_xpu_kernels, absent from a CPU box
            return f"its kernel cannot be asked here ({type(error).__name__}: {error})"
    moe = built.model.language_model.model.layers[main_moe_layers(layers)[0]]
    return moe.block_sparse_moe.experts.routed_experts.quant_method


def kernel_on_gpu(
    text_config: dict[str, Any],
    deployment: Deployment,
    capability: tuple[int, int] | None,
    quantization_config: dict[str, Any] | None = None,
) -> KernelOnGpu:
    """What vLLM selects for ``deployment``'s ``--moe-backend`` on a GPU of
    ``capability`` (None: any GPU that runs the kernel; on an AMD GPU named,
    ``gpus.an_amd_gpu_named``: that one): the MoE layer built as plan builds
    it, each kernel's device check answering as on that GPU. Imports
    vLLM."""
    method = _routed_method(text_config, deployment, capability, quantization_config)
    if isinstance(method, str):
        return KernelOnGpu(deployment.backend, None, method)
    chosen = getattr(method, "experts_cls", None)
    if chosen is None:  # the method runs its own kernel, which vLLM checked
        return KernelOnGpu(deployment.backend, type(method).__name__)
    if named_amd_arch() is not None:  # ROCm's own device checks answered
        return KernelOnGpu(deployment.backend, chosen.__name__)
    # None on every GPU generation: its check asks for what this machine lacks
    asked = capability or SERVING_GPU_CAPABILITY
    verified = runs_on_capability(chosen, asked) is not None
    return KernelOnGpu(deployment.backend, chosen.__name__, verified=verified)


def candidate_backends(deployment: Deployment) -> tuple[str, ...]:
    """The ``--moe-backend`` names ``deployment``'s experts may run on: its
    format's; for a method quantizing the BF16 checkpoint while loading it
    (whose kernels no format lists), every format's (the NVIDIA kernels
    plan knows; vLLM's selection refuses those the method does not take);
    on an AMD GPU named, ROCm's (``gpus.AMD_MOE_BACKENDS``)."""
    if named_amd_arch() is not None:
        return amd_moe_backends(deployment.quantization)
    if deployment.online is None:
        return format_named(deployment.quantization).moe_backends
    return tuple(dict.fromkeys(b for fmt in FORMATS for b in fmt.moe_backends))


def other_backends(
    text_config: dict[str, Any],
    deployment: Deployment,
    capability: tuple[int, int] | None,
    quantization_config: dict[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """The other ``--moe-backend`` names vLLM builds ``deployment`` on, on a
    GPU of ``capability`` (None: any): (those whose kernel runs there, those
    whose kernel's device check asks for a library this machine lacks)."""
    answers = [
        kernel_on_gpu(
            text_config,
            replace(deployment, backend=backend),
            capability,
            quantization_config,
        )
        for backend in candidate_backends(deployment)
        if backend != deployment.backend
    ]
    running = [answer.backend for answer in answers if answer.runs and answer.verified]
    untold = [
        answer.backend for answer in answers if answer.runs and not answer.verified
    ]
    return running, untold


def _in_words(running: list[str], untold: list[str]) -> str:
    """Backends that run, and those not known here, in words."""
    return ", ".join(running) + (
        f" (not known here: {', '.join(untold)}, whose kernels need a "
        "library this machine lacks)"
        if untold
        else ""
    )


def what_builds_instead(
    text_config: dict[str, Any],
    deployment: Deployment,
    capability: tuple[int, int] | None,
    quantization_config: dict[str, Any] | None = None,
) -> str:
    """Where vLLM refuses to build ``deployment`` on a GPU of ``capability``
    (None: no GPU named), what it builds instead, in words: the other
    ``--moe-backend`` names it builds on; with no GPU named and none, the
    ``--gpu`` presets it builds on. Empty where nothing was found."""
    running, untold = other_backends(
        text_config, deployment, capability, quantization_config
    )
    if running or untold:
        return f"vLLM builds it with --moe-backend {_in_words(running, untold)}"
    if capability is not None or named_amd_arch() is not None:
        return ""
    builds = {
        of: kernel_on_gpu(text_config, deployment, of, quantization_config).runs
        for of in set(GPU_CAPABILITY.values())
    }
    gpus = [gpu for gpu, of in GPU_CAPABILITY.items() if builds[of]]
    return f"vLLM builds it on --gpu {', '.join(gpus)}" if gpus else ""


def refuse_a_kernel_the_gpu_cannot_run(
    text_config: dict[str, Any],
    deployment: Deployment,
    gpu: str,
    quantization_config: dict[str, Any] | None = None,
) -> KernelOnGpu:
    """vLLM's selection for ``deployment``'s ``--moe-backend`` on ``gpu``;
    ``DeploymentError`` where it selects no kernel for ``deployment``'s
    ``--moe-backend`` on ``gpu`` (a ``--gpu`` preset), naming vLLM's reason
    and the other backends that do run there. Imports vLLM."""
    capability = GPU_CAPABILITY.get(gpu.lower())  # None: an AMD GPU's
    answer = kernel_on_gpu(text_config, deployment, capability, quantization_config)
    if answer.runs:
        return answer
    _refuse_where_aiter_is_missing(text_config, deployment, gpu, quantization_config)
    running, untold = other_backends(
        text_config, deployment, capability, quantization_config
    )
    which = (
        "ROCm" if capability is None else "compute capability {}.{}".format(*capability)
    )
    raise DeploymentError(
        f"--moe-backend {deployment.backend} does not run on {gpu} ({which}): "
        "vLLM selects no kernel for it there "
        f"({answer.refusal}); on {gpu} "
        f"{deployment.online or deployment.quantization} runs on "
        f"{_in_words(running, untold) or 'none of its backends'}"
    )


def _refuse_where_aiter_is_missing(
    text_config: dict[str, Any],
    deployment: Deployment,
    gpu: str,
    quantization_config: dict[str, Any] | None,
) -> None:
    """On the AMD GPU named with AITER off, where vLLM selects a kernel for
    ``deployment``'s ``--moe-backend`` once AITER is on: a
    ``DeploymentError`` naming the variable that turns it on."""
    arch = named_amd_arch()
    if arch in (None, XPU) or named_aiter():
        return
    with an_amd_gpu_named(arch, aiter=True):
        with_aiter = kernel_on_gpu(text_config, deployment, None, quantization_config)
    if with_aiter.runs:
        raise DeploymentError(
            f"--moe-backend {deployment.backend} needs {AITER_VARIABLE}=1 on "
            f"{gpu}: vLLM selects its kernel ({with_aiter.kernel}) only with "
            f"AITER on; set it where vllm serve runs (and where plan or check "
            "run, to plan it)"
        )


def backend_vllm_selects_on_amd(
    text_config: dict[str, Any],
    quantization: str,
    quantization_config: dict[str, Any] | None = None,
) -> tuple[str, str | None]:
    """The ``--moe-backend`` to plan ``quantization`` on, on the AMD (or
    Intel) GPU named (``gpus.an_amd_gpu_named``, entered by the caller; AITER
    as vLLM reads ``VLLM_ROCM_USE_AITER``), and None; or, where vLLM's
    ``--moe-backend auto`` selects no kernel there, the first of that
    platform's names vLLM builds, and why auto did not (one line). vLLM's
    AMD ``KimiMoE`` is built as plan builds it; the backend its MXFP4 method
    picked under auto is named by the ``--moe-backend`` whose candidates
    (vLLM's ``map_mxfp4_backend``) hold it. A ``DeploymentError`` where
    vLLM builds none. Imports vLLM."""
    deployment = Deployment(8, backend="auto", quantization=quantization)
    method = _routed_method(text_config, deployment, None, quantization_config)
    names = amd_moe_backends(quantization)
    if isinstance(method, str):  # auto selects nothing: the first that builds
        for name in names:
            named = replace(deployment, backend=name)
            if kernel_on_gpu(text_config, named, None, quantization_config).runs:
                return name, method
        raise DeploymentError(
            f"vLLM selects no MoE kernel for {quantization} there ({method}), "
            f"nor on --moe-backend {', '.join(names)}"
        )
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        map_mxfp4_backend,
    )

    chosen = getattr(method, "mxfp4_backend", None)
    for name in names:
        if chosen in map_mxfp4_backend(name):
            return name, None
    raise DeploymentError(
        f"vLLM selects {chosen} for {quantization} there, which none of the "
        f"--moe-backend names plan knows there picks ({', '.join(names)})"
    )
