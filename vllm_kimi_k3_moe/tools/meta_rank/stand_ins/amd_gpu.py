"""The AMD GPU ``plan --gpu NAME`` names, stood in while the tools make
vLLM's configs and build its model: ``rocm_platform.an_amd_gpu`` on the
named architecture, with AITER as plan plans it (``aiter_planned``).

Why a module of its own: ``rocm_platform`` stands in for a GPU of a given
architecture and AITER setting; which ones a plan is for is the tools'
question (``deployment.gpus.an_amd_gpu_named`` holds the architecture, plain
Python, so the command line can hold it before vLLM is imported). AITER's
MoE is on where ``VLLM_ROCM_USE_AITER`` says so, read by vLLM's own
``vllm.envs``; unset, as vLLM's recipe serves the architecture (on for
CDNA4, where vLLM then selects AITER's MXFP4 experts; off for CDNA3, vLLM's
default, where it selects the emulation experts either way). Emulation's
MoE build needs vLLM's SiTU op, a compiled op a CPU box lacks
(``moe_forward.situ_and_mul_op_on_cpu``), and a SiLU MLP (the DSpark
draft's) vLLM's SiLU op (``moe_forward.silu_and_mul_op_on_cpu``); nothing
else changes. On an
Intel GPU (``XPU``) ``rocm_platform.an_intel_gpu`` stands in instead.
Holds no parameters.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from unittest import mock

from vllm_kimi_k3_moe.tools.deployment.gpus import (
    AITER_VARIABLE,
    RECIPE_AITER_ARCHS,
    XPU,
    named_aiter,
    named_amd_arch,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.moe_forward import (
    silu_and_mul_op_on_cpu,
    situ_and_mul_op_on_cpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_platform import (
    CDNA3,
    CDNA4,
    an_amd_gpu,
    an_intel_gpu,
)

# ``GpuPreset.arch`` -> the gcnArchName ROCm reports for it
_REPORTED = {reported.split(":")[0]: reported for reported in (CDNA3, CDNA4)}


def aiter_enabled() -> bool:
    """vLLM's own reading of ``VLLM_ROCM_USE_AITER`` (off by default)."""
    from vllm import envs

    return bool(envs.VLLM_ROCM_USE_AITER)


def aiter_served(arch: str | None, environment: Mapping[str, str]) -> bool:
    """Whether a server on the AMD GPU of ``arch`` runs with AITER on, as
    vLLM reads ``VLLM_ROCM_USE_AITER`` from ``environment`` (a serve line's
    ``NAME=VALUE`` words) where it gives the variable, else from this
    process's environment, which a server started from the same shell
    inherits."""
    if arch is None or arch == XPU:
        return False
    if AITER_VARIABLE not in environment:
        return aiter_enabled()
    with mock.patch.dict(os.environ, {AITER_VARIABLE: environment[AITER_VARIABLE]}):
        return aiter_enabled()


def aiter_planned(arch: str | None) -> bool:
    """Whether plan plans the AMD GPU of ``arch`` with AITER on: as
    ``VLLM_ROCM_USE_AITER`` says where it is set (vLLM's reading), else as
    vLLM's recipe serves that architecture (``gpus.RECIPE_AITER_ARCHS``)."""
    if arch is None or arch == XPU:
        return False
    if AITER_VARIABLE in os.environ:
        return aiter_enabled()
    return arch in RECIPE_AITER_ARCHS


@contextmanager
def as_on_the_named_amd_gpu() -> Iterator[bool]:
    """While entered, vLLM's platform is ROCm on the AMD GPU
    ``an_amd_gpu_named`` holds (its architecture, AITER as it holds it),
    or XPU where it holds ``XPU`` (``rocm_platform.an_intel_gpu``), and
    yields True; where none is named, nothing changes and it yields
    False."""
    arch = named_amd_arch()
    if arch is None:
        yield False
        return
    with ExitStack() as stack:
        if arch == XPU:  # an Intel GPU: vLLM builds the same AMD model there
            stack.enter_context(an_intel_gpu())
        else:
            stack.enter_context(an_amd_gpu(_REPORTED[arch], aiter=named_aiter()))
        stack.enter_context(situ_and_mul_op_on_cpu())
        stack.enter_context(silu_and_mul_op_on_cpu())
        yield True
