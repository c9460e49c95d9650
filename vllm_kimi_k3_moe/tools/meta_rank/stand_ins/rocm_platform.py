"""Stands in for an AMD GPU while vLLM builds Kimi-K3's MoE on a CPU box: the
ROCm platform, its GPU architecture (CDNA3: MI300X, MI325X; CDNA4: MI355X),
and the AITER switches vLLM reads where the ``aiter`` package is absent; and
for an Intel GPU (XPU), which builds the same AMD model (``an_intel_gpu``).

Why: on ROCm vLLM builds Kimi-K3 from ``vllm/models/kimi_k3/amd/linear.py``
and selects the MoE backend by asking the platform (``is_rocm``), the GPU
architecture (``vllm.platforms.rocm``'s ``_GCN_ARCH`` and the ``_ON_*``
flags it derives at import) and AITER (``vllm._aiter_ops``: found, enabled
for MoE, which SiTU variant). A CPU box has none of them. What the real ones
guarantee, and each stand-in reproduces: the platform enum says ROCm; the
architecture flags are those vLLM's own ``platforms/rocm.py`` derives from
the architecture name the GPU reports (its module executed again on that
name, never restated here); AITER is found and its MoE switch on, as
``VLLM_ROCM_USE_AITER=1`` makes it on a GPU with the package (off: vLLM's
default, where CDNA3 falls back to emulation); emulation's ``amd-quark``
check answers as with the package installed. Everything else, the backend
oracle, each kernel's ``is_supported_config`` and the sizing rules, is
vLLM's own code. AITER's kernels and weight shuffles cannot run here.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

from vllm_kimi_k3_moe.patching import replaced_attributes

# GPU architecture names as ROCm reports them (``gcnArchName``)
CDNA3 = "gfx942:sramecc+:xnack-"  # MI300X, MI325X
CDNA4 = "gfx950:sramecc+:xnack-"  # MI355X
_ROCM_MODULE = "vllm.platforms.rocm"


def _reporting(arch: str) -> Any:
    """``torch.cuda.get_device_properties`` as a GPU of ``arch`` answers
    the one question ``platforms/rocm.py`` asks at import (where amdsmi,
    which it asks first, is absent or finds no GPU)."""
    return mock.patch(
        "torch.cuda.get_device_properties",
        lambda *args, **kwargs: SimpleNamespace(gcnArchName=arch),
    )


def rocm_module() -> Any:
    """vLLM's ``vllm.platforms.rocm``, imported once (its architecture flags
    then those of CDNA3, until ``an_amd_gpu`` sets others)."""
    if _ROCM_MODULE not in sys.modules:
        with _reporting(CDNA3):
            importlib.import_module(_ROCM_MODULE)
    return sys.modules[_ROCM_MODULE]


@functools.cache
def architecture_flags(arch: str) -> dict[str, Any]:
    """The module-level architecture values (``_GCN_ARCH``, ``_ON_*``) vLLM's
    ``platforms/rocm.py`` computes on a GPU reporting ``arch``: its own code,
    executed in a scratch copy of the module (nothing of it is kept but
    these values)."""
    spec = importlib.util.find_spec(_ROCM_MODULE)
    scratch = importlib.util.module_from_spec(spec)
    with _reporting(arch):
        spec.loader.exec_module(scratch)
    return {
        name: value
        for name, value in vars(scratch).items()
        if name == "_GCN_ARCH" or name.startswith("_ON_")
    }


def _yes(*args: Any, **kwargs: Any) -> bool:
    return True


@contextmanager
def an_amd_gpu(arch: str = CDNA3, *, aiter: bool = False) -> Iterator[None]:
    """While entered, vLLM's current platform is ROCm on a GPU of ``arch``
    (``CDNA3`` or ``CDNA4``), with AITER's MoE on where ``aiter`` (as
    ``VLLM_ROCM_USE_AITER=1`` on a GPU with the package), and emulation's
    ``amd-quark`` present. Holds no parameters."""
    from vllm import _aiter_ops
    from vllm.platforms import PlatformEnum, current_platform

    rocm = rocm_module()
    ops = _aiter_ops.rocm_aiter_ops
    with ExitStack() as stack:
        stack.enter_context(
            replaced_attributes(type(current_platform), _enum=PlatformEnum.ROCM)
        )
        stack.enter_context(replaced_attributes(rocm, **architecture_flags(arch)))
        stack.enter_context(replaced_attributes(_aiter_ops, IS_AITER_FOUND=aiter))
        stack.enter_context(
            replaced_attributes(ops, _AITER_ENABLED=aiter, _FMOE_ENABLED=aiter)
        )
        stack.enter_context(emulation_available())
        yield


@contextmanager
def emulation_available() -> Iterator[None]:
    """vLLM's OCP MX emulation experts (``experts/ocp_mx_emulation_moe.py``)
    answer as with ``amd-quark`` installed, which they ask for
    (``has_quark``) and vLLM's ROCm images ship; their dequantization is
    quark's, which runs on a GPU only. Holds no parameters."""
    from vllm.model_executor.layers.fused_moe.experts import ocp_mx_emulation_moe

    with replaced_attributes(ocp_mx_emulation_moe, has_quark=_yes):
        yield


@contextmanager
def an_intel_gpu() -> Iterator[None]:
    """While entered, vLLM's current platform is XPU (Intel Data Center GPU
    Max), where it builds Kimi-K3's MoE from ``amd/linear.py`` as on ROCm,
    and emulation's ``amd-quark`` is present (``--moe-backend emulation``:
    vLLM's XPU experts do not list SiTU, and their kernels,
    ``vllm_xpu_kernels``, are not on a CPU box). Holds no parameters."""
    from vllm.platforms import PlatformEnum, current_platform

    with (
        replaced_attributes(type(current_platform), _enum=PlatformEnum.XPU),
        emulation_available(),
    ):
        yield


@contextmanager
def aiter_off() -> Iterator[None]:
    """AITER's switches off for the block (inside ``an_amd_gpu(...,
    aiter=True)``): vLLM's own non-AITER code runs where it would call one of
    AITER's GPU kernels (the router's grouped top-k), as with
    ``VLLM_ROCM_USE_AITER=0``. Holds no parameters."""
    from vllm import _aiter_ops

    ops = _aiter_ops.rocm_aiter_ops
    with replaced_attributes(ops, _AITER_ENABLED=False, _FMOE_ENABLED=False):
        yield
