"""Stands in for what a CPU box lacks when vLLM builds its AMD Kimi-K3 (the
model it serves on ROCm) on the ``meta`` device: the platform vLLM's
``vllm.models.kimi_k3`` package chose its classes by when it was imported,
the current device, and the one AITER kernel the KDA layer takes a handle
of while it is built.

Why each, and what the real one guarantees:

- ``vllm.models.kimi_k3`` exports the AMD classes (``amd.linear``'s
  ``KimiLinearForCausalLM``, ``amd.mtp``'s ``KimiK3MTP``) when the platform
  is ROCm at its import, the NVIDIA ones otherwise; the model registry
  resolves the language model and the MTP draft through those exports
  (``KimiLinearForCausalLM``, ``KimiK3MTPModel``) and caches what it
  resolved. On a CPU box the package was imported under the CPU platform:
  while entered it exports what it exports on ROCm (vLLM's own AMD classes),
  and the registry's cache is emptied on entry and exit.
- ``current_platform.current_device()``: the AMD wrapper moves its vision
  tower and projector there; a CPU box's platform has no current device. It
  answers ``meta``, where the tools build every parameter (the real one is
  the GPU; the parameters are the same).
- ``aiter.ops.triton.gated_delta_net.causal_conv1d_split_qkv_triton_tile_fn``:
  the AMD KDA layer keeps a handle to this Triton kernel where AITER is on
  (vLLM's ROCm images ship AITER with it) and calls it in the forward only.
  Where the ``aiter`` package is absent (a CPU box) that one module is
  stood in, its kernel raising if called; nothing else of AITER is, so
  vLLM's probes of AITER's other kernels (its Gluon KDA prefill and decode)
  find them absent.
- vLLM 0.33's ``VllmConfig`` asks whether Triton is found to pick its model
  runner; on a ROCm GPU it is (``triton_as_on_the_gpu``).

Holds no parameters.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.amd_gpu import (
    as_on_the_named_amd_gpu,
)

_KDA_KERNEL_MODULE = "aiter.ops.triton.gated_delta_net"


@contextmanager
def rocm_model_exports() -> Iterator[None]:
    """While entered, ``vllm.models.kimi_k3`` exports what it exports on
    ROCm, and vLLM's model registry resolves its architectures anew."""
    from vllm.model_executor.models import registry

    kimi_k3 = importlib.import_module("vllm.models.kimi_k3")
    amd_linear = importlib.import_module("vllm.models.kimi_k3.amd.linear")
    amd_model = importlib.import_module("vllm.models.kimi_k3.amd.model")
    amd_mtp = importlib.import_module("vllm.models.kimi_k3.amd.mtp")
    registry._try_load_model_cls.cache_clear()
    try:
        with replaced_attributes(
            kimi_k3,
            KimiLinearForCausalLM=amd_linear.KimiLinearForCausalLM,
            KimiK3ForConditionalGeneration=amd_model.KimiK3ForConditionalGeneration,
            KimiK3MTP=amd_mtp.KimiK3MTP,
        ):
            yield
    finally:
        registry._try_load_model_cls.cache_clear()


@contextmanager
def the_meta_device_as_current() -> Iterator[None]:
    """``current_platform.current_device()`` answers ``meta``."""
    import torch
    from vllm.platforms import current_platform

    with replaced_attributes(
        current_platform, current_device=lambda: torch.device("meta")
    ):
        yield


def _not_on_this_machine(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("AITER's KDA kernel is not on this machine (a stand-in)")


@contextmanager
def aiter_kda_kernel_handle() -> Iterator[None]:
    """``aiter.ops.triton.gated_delta_net`` importable with the kernel the
    AMD KDA layer takes a handle of, where ``aiter`` is absent."""
    if importlib.util.find_spec("aiter") is not None:
        yield
        return
    names = ("aiter", "aiter.ops", "aiter.ops.triton", _KDA_KERNEL_MODULE)
    kernels = ModuleType(_KDA_KERNEL_MODULE)
    kernels.causal_conv1d_split_qkv_triton_tile_fn = _not_on_this_machine
    # only these names, added and removed: what the build imports meanwhile
    # stays imported
    sys.modules.update({name: ModuleType(name) for name in names[:-1]})
    sys.modules[_KDA_KERNEL_MODULE] = kernels
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


@contextmanager
def triton_as_on_the_gpu() -> Iterator[None]:
    """vLLM 0.33's ``VllmConfig`` finds Triton (``HAS_TRITON``) as on a
    ROCm GPU, where vLLM's images ship it: on a platform that is not the
    unspecified one it picks its model runner by it (V1 without it, which
    refuses DSpark drafts). A CPU box's Triton finds no GPU driver. vLLM
    0.34 does not ask: nothing is replaced."""
    from vllm.config import vllm as config_module

    if not hasattr(config_module, "HAS_TRITON"):
        yield
        return
    with replaced_attributes(config_module, HAS_TRITON=True):
        yield


@contextmanager
def vllms_amd_model_on_cpu() -> Iterator[None]:
    """The stand-ins above, entered together (inside
    ``rocm_platform.an_amd_gpu``)."""
    with ExitStack() as stack:
        stack.enter_context(rocm_model_exports())
        stack.enter_context(the_meta_device_as_current())
        stack.enter_context(aiter_kda_kernel_handle())
        stack.enter_context(triton_as_on_the_gpu())
        yield


def fused_kda_chunk_would_run() -> bool:
    """Whether vLLM's ROCm KDA layer would run its fused KDA chunk kernel on
    the AMD GPU ``an_amd_gpu_named`` holds, were vLLM built with it: vLLM's
    own ``is_fused_kda_chunk_supported`` asked with the compiled op
    ``torch.ops._C.fused_kda_chunk`` stood in as present (a build option of
    vLLM's ROCm wheel this machine cannot tell). With it each request keeps
    one prefill-checkpoint state block per KDA layer more (the layer's
    ``get_kv_cache_spec``); the build here resolves without it."""
    import torch
    from vllm.models.kimi_k3.amd.ops.kda_chunk import is_fused_kda_chunk_supported

    # vLLM caches its answer (a process has one GPU): asked afresh, and
    # forgotten, so that what is built here answers as this machine does
    is_fused_kda_chunk_supported.cache_clear()
    try:
        with (
            as_on_the_named_amd_gpu(),
            replaced_attributes(torch.ops._C, fused_kda_chunk=_not_on_this_machine),
        ):
            return is_fused_kda_chunk_supported()
    finally:
        is_fused_kda_chunk_supported.cache_clear()
