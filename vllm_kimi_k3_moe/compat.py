"""Which vLLM releases the plugin was verified against, and every place where
those releases differ.

The patches and the tools read as if one vLLM existed. Where vLLM 0.33 and
0.34 differ in something they use, they call a function here, named for what
changed and saying in which release; nothing else in the package asks which
vLLM is installed. Each function imports vLLM inside itself: ``register()``
imports this module in every vLLM process and must stay cheap.

The refusals return ``None`` when patching is safe, otherwise the sentence
the plugin logs instead of patching.
"""

from __future__ import annotations

import inspect
import sys
from importlib import metadata
from importlib.util import find_spec
from typing import Any

# The one place the verified vLLM releases are named: the current release and
# the previous one. The patches rewrite private construction details of the
# releases they were written and verified against; on any other vLLM (a later
# release, a nightly, a fork) the plugin judges each patch on that vLLM's code
# before it applies any (``vllm_kimi_k3_moe.verification``), so pyproject.toml's
# vllm requirement admits these and every later release (a test ties the two).
VERIFIED_VLLM_RELEASES = ("0.33.0", "0.34.0")
SUPPORTED_VLLM_SERIES = tuple(
    tuple(int(n) for n in release.split(".")[:2]) for release in VERIFIED_VLLM_RELEASES
)


def installed_vllm_release() -> str | None:
    """The installed vLLM's version, from its package metadata (vLLM is not
    imported); ``None`` where no vLLM is installed."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _series_of(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in version.split(".")[:2] if n.isdigit())


def _release_named() -> str:
    """The release messages name: the installed one where it is supported,
    else the newest verified."""
    installed = installed_vllm_release()
    if installed is not None and _series_of(installed) in SUPPORTED_VLLM_SERIES:
        return installed
    return VERIFIED_VLLM_RELEASES[-1]


def __getattr__(name: str) -> str:
    """``VLLM``: the vLLM messages name, "vLLM <installed release>". Read on
    first use, so that registering the plugin reads no package metadata."""
    if name == "VLLM":
        return f"vLLM {_release_named()}"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_vllm_series() -> str:
    """``SUPPORTED_VLLM_SERIES`` as users write it: ``0.33.x or 0.34.x``."""
    return " or ".join(".".join(map(str, s)) + ".x" for s in SUPPORTED_VLLM_SERIES)


def kimi_k3_platform_refusal() -> str | None:
    """Mirror ``vllm/models/kimi_k3/__init__.py``: which implementation runs.
    CUDA builds the NVIDIA model, ROCm and XPU the AMD one
    (``amd/linear.py``): the plugin patches both. A TPU runs its plugin's own
    model."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "tpu":
        return None
    return (
        "vllm-kimi-k3-moe patches vLLM's Kimi-K3 models for NVIDIA, AMD and "
        "Intel GPUs; this platform runs the TPU plugin's own model, which is "
        "left as it is (nothing patched)."
    )


def kimi_k3_model_module() -> str:
    """The module vLLM builds Kimi-K3's MoE from on this platform
    (``vllm/models/kimi_k3/__init__.py``): ``amd/linear.py`` on ROCm and XPU,
    else NVIDIA's ``nvidia/model.py``."""
    from vllm.platforms import current_platform

    if current_platform.is_rocm() or current_platform.is_xpu():
        return "vllm.models.kimi_k3.amd.linear"
    return "vllm.models.kimi_k3.nvidia.model"


# --- Where vLLM 0.33 and 0.34 differ -----------------------------------------


def marlin_int8_activations_exist() -> bool:
    """vLLM 0.34 removed Marlin's INT8/FP8-activation path
    (``VLLM_MARLIN_INPUT_DTYPE``; ``is_a_8bit`` in Marlin's permutations,
    ``input_dtype`` in the integer MoE preparation); 0.33 has it."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils

    permute = inspect.signature(marlin_utils.marlin_permute_scales)
    return "is_a_8bit" in permute.parameters


def marlin_8bit_activation_kwargs(is_a_8bit: bool) -> dict[str, Any]:
    """The keyword Marlin's permutations take for 8-bit activations: on vLLM
    0.33 ``is_a_8bit``; 0.34 has no such path (asking for it is an error)."""
    if marlin_int8_activations_exist():
        return {"is_a_8bit": is_a_8bit}
    if is_a_8bit:
        raise ValueError("this vLLM has no Marlin path for 8-bit activations")
    return {}


def marlin_weight_perm(num_bits: int, is_a_8bit: bool = False) -> Any:
    """vLLM's Marlin weight permutation (``marlin_utils_test.get_weight_perm``,
    which took ``is_a_8bit`` positionally up to 0.33)."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test

    if marlin_int8_activations_exist():
        return marlin_utils_test.get_weight_perm(num_bits, is_a_8bit)
    marlin_8bit_activation_kwargs(is_a_8bit)
    return marlin_utils_test.get_weight_perm(num_bits)


def dequantized_nvfp4_moe_weights(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """vLLM's ``dequantize_nvfp4_moe_weights`` as one ``(w13, w2)`` pair over
    every expert: 0.33 returns the pair; 0.34 yields ``(experts, w13, w2)``
    chunks, ``experts`` the slice of experts each holds, put together here."""
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_nvfp4_moe_weights,
    )

    result = dequantize_nvfp4_moe_weights(*args, **kwargs)
    if isinstance(result, tuple):
        return result
    chunks = list(result)
    experts = args[0].shape[0] if args else kwargs["w13_weight_packed"].shape[0]
    w13 = torch.empty((experts, *chunks[0][1].shape[1:]), dtype=chunks[0][1].dtype)
    w2 = torch.empty((experts, *chunks[0][2].shape[1:]), dtype=chunks[0][2].dtype)
    covered = torch.zeros(experts, dtype=torch.bool)
    for where, w13_chunk, w2_chunk in chunks:
        w13[where], w2[where] = w13_chunk, w2_chunk
        covered[where] = True
    assert bool(covered.all()), "vLLM's chunks left experts out"
    return w13, w2


def resolved_gpu_memory_utilization(cache_config: Any) -> float:
    """The share of each GPU vLLM takes for a ``CacheConfig``: 0.33's field
    (default 0.92); 0.34 leaves the field ``None`` by default and resolves it
    (``resolved_gpu_memory_utilization``: 1.0 with the extensible KV cache,
    on by default on CUDA, else 0.92)."""
    resolved = getattr(type(cache_config), "resolved_gpu_memory_utilization", None)
    if resolved is None:
        return cache_config.gpu_memory_utilization
    return cache_config.resolved_gpu_memory_utilization


def extensible_kv_cache_resolver() -> str | None:
    """The ``VllmConfig`` method by which vLLM 0.34 settles its extensible KV
    cache (``_resolve_extensible_kv_cache``: on where the platform supports
    it, CUDA and ROCm, unless asked otherwise); ``None`` on vLLM 0.33, which
    has no extensible KV cache."""
    from vllm.config import VllmConfig

    name = "_resolve_extensible_kv_cache"
    return name if hasattr(VllmConfig, name) else None


def kv_cache_sizing_after_warmup(cache_config: Any) -> Any:
    """vLLM 0.34's ``v1/worker/extensible_kv_cache.py`` (its
    ``measure_kv_cache_bytes`` and margin constants) where ``cache_config``
    has the extensible KV cache on, 0.34's default on CUDA: the KV cache is
    then sized from the memory measured after warmup, and the CUDA context
    and NCCL's buffers come out of it. ``None`` where vLLM sizes it from its
    start-up profile within ``gpu_memory_utilization`` of each GPU: 0.34 with
    the extensible KV cache off, and 0.33, which has none."""
    if not getattr(cache_config, "enable_extensible_kv_cache", False):
        return None
    from vllm.v1.worker import extensible_kv_cache

    return extensible_kv_cache


def builds_dsa_layers() -> bool:
    """vLLM 0.34's Kimi-K3 model builds DSA (sparse) attention layers, each
    with its indexer, where its config has ``dsa_config``
    (``KimiLinearConfig.is_dsa_layer``); vLLM 0.33 reads no ``dsa_config``
    and builds those layers as dense MLA."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    return hasattr(KimiLinearConfig, "is_dsa_layer")


def dsa_topk_indices_buffer(kimi_linear_model: Any) -> Any:
    """The one top-k buffer vLLM 0.34's ``KimiLinearModel`` allocates for all
    its DSA layers when it is built (``topk_indices_buffer``: int32,
    ``max_num_batched_tokens`` (+ DCP slack) x ``index_topk``), a tensor that
    is not a parameter; ``None`` without DSA layers, and on vLLM 0.33."""
    return getattr(kimi_linear_model, "topk_indices_buffer", None)


def lut_b_online_quantization_exists() -> bool:
    """vLLM 0.34 added online LUT-B quantization of MoE experts
    (``--quantization lut_b_moe``: ``LutBOnlineMoEMethod``,
    ``quantization/online/lut_b.py``); 0.33 has none."""
    return find_spec("vllm.model_executor.layers.quantization.online.lut_b") is not None


def moe_padding_fill_params(experts: Any) -> list[str] | None:
    """The parameters of a ``RoutedExperts`` layer a direct-mode reload
    zero-fills whole before it writes the checkpoint's bytes: vLLM 0.34 added
    ``RoutedExperts.padding_fill_params`` (read when the checkpoint layout is
    recorded, ``reload/direct.py``; non-empty only where the layer records
    fewer rows held than it allocates); 0.33 has no direct-mode reload
    (None)."""
    fill = getattr(experts, "padding_fill_params", None)
    return None if fill is None else fill()


def load_plan_trace_name(tensor: Any) -> str | None:
    """The checkpoint name a data-free tensor of vLLM 0.34's load planning
    stands for (``reload/trace.py``: ``plan_loads`` runs ``load_weights`` once
    over ``TraceTensor``s to learn where each name lands); ``None`` for a
    tensor with data, and on vLLM 0.33, which has no load plans."""
    trace = _trace_tensor_class()
    if trace is None or not isinstance(tensor, trace):
        return None
    return tensor._name


def _trace_tensor_class() -> Any:
    module = sys.modules.get("vllm.model_executor.model_loader.reload.trace")
    # only planning imports it; not imported, no tensor of it exists
    return getattr(module, "TraceTensor", None)
