"""The AMD GPU ``plan --gpu NAME`` names, stood in while the tools make
vLLM's configs and build its model: ``rocm_platform.an_amd_gpu`` on the
named architecture, with AITER as vLLM itself has it on that machine.

Why a module of its own: ``rocm_platform`` stands in for a GPU of a given
architecture and AITER setting; which ones a plan is for is the tools'
question (``deployment.gpus.an_amd_gpu_named`` holds the architecture, plain
Python, so the command line can hold it before vLLM is imported). AITER's
MoE is on where ``VLLM_ROCM_USE_AITER`` says so, read by vLLM's own
``vllm.envs`` (off by default: on CDNA3 and CDNA4 vLLM then selects the
emulation experts). Emulation's MoE build needs vLLM's SiTU op, a compiled
op a CPU box lacks (``moe_forward.situ_and_mul_op_on_cpu``); nothing else
changes. On an Intel GPU (``XPU``) ``rocm_platform.an_intel_gpu`` stands
in instead. Holds no parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from vllm_kimi_k3_moe.tools.deployment.gpus import XPU, named_amd_arch
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.moe_forward import (
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


@contextmanager
def as_on_the_named_amd_gpu() -> Iterator[bool]:
    """While entered, vLLM's platform is ROCm on the AMD GPU
    ``an_amd_gpu_named`` holds (its architecture, AITER as vLLM reads it),
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
            stack.enter_context(an_amd_gpu(_REPORTED[arch], aiter=aiter_enabled()))
        stack.enter_context(situ_and_mul_op_on_cpu())
        yield True
