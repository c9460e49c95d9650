"""vLLM's AMD Kimi-K3 MoE (``vllm/models/kimi_k3/amd/linear.py``, what ROCm and
XPU build) on a CPU box, as on an AMD GPU.

Everything under test is vLLM's own code with the plugin registered. What a
CPU box lacks is stood in, each in one shared place: the ROCm platform, the
GPU architecture and AITER's switches (``stand_ins.rocm_platform``), the SiTU
op of the shared experts' activation (``stand_ins.moe_forward``) and the
CUDA stream vLLM's MoE runner asks for (``stand_ins.cuda_streams``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest

import vllm_kimi_k3_moe
from tests.models.kimi_k3.builders import kimi_k3_text_config
from tests.models.kimi_k3.kimi_k3_formats import format_vllm_config
from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.cuda_streams import (
    cuda_streams_and_events,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.moe_forward import (
    situ_and_mul_op_on_cpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_platform import (
    CDNA3,
    CDNA4,
    an_amd_gpu,
    an_intel_gpu,
)

# (GPU architecture, AITER on): vLLM's default on CDNA3 (MI300X, MI325X),
# where AITER's MXFP4 kernel does not run (gfx950 only) and vLLM selects
# emulation; CDNA4 (MI355X) with AITER on (VLLM_ROCM_USE_AITER=1), where it
# selects AITER's MXFP4 kernel. "xpu": an Intel GPU, on emulation.
AMD_GPUS = {"cdna3": (CDNA3, False), "cdna4-aiter": (CDNA4, True)}
# --moe-backend on each: vLLM's default on ROCm; emulation on XPU, whose own
# MXFP4 experts do not take SiTU
MOE_BACKEND = {"cdna3": "auto", "cdna4-aiter": "auto", "xpu": "emulation"}


@pytest.fixture(scope="session")
def amd_model() -> ModuleType:
    """vLLM's AMD Kimi-K3 language model module, imported once, patched."""
    vllm_kimi_k3_moe.register()
    return importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_AMD_LINEAR)


@contextmanager
def on_an_amd_gpu(gpu: str) -> Iterator[None]:
    """vLLM as on the GPU ``gpu`` names (``AMD_GPUS``, or ``xpu``), with what
    its MoE layer asks of a GPU while it is built stood in."""
    if gpu == "xpu":
        platform = an_intel_gpu()
    else:
        arch, aiter = AMD_GPUS[gpu]
        platform = an_amd_gpu(arch, aiter=aiter)
    with platform, situ_and_mul_op_on_cpu(), cuda_streams_and_events():
        yield


def build_amd_kimi_moe(
    amd_model: ModuleType,
    gpu: str,
    topology: Topology,
    *,
    upstream: bool = False,
    device: str = "meta",
) -> Any:
    """One real AMD ``KimiMoE`` (patched unless ``upstream``) serving the
    MXFP4 release checkpoint as GPU 0 of ``topology`` on ``gpu``, built as
    its ``KimiDecoderLayer`` builds it (keywords), at Kimi-K3's real size."""
    import torch
    from vllm.config import set_current_vllm_config

    cls = upstream_class(amd_model.KimiMoE) if upstream else amd_model.KimiMoE
    with on_an_amd_gpu(gpu), simulated_rank(topology):
        vllm_config = format_vllm_config(topology, "mxfp4", MOE_BACKEND[gpu])
        with set_current_vllm_config(vllm_config), torch.device(device):
            return cls(
                config=kimi_k3_text_config(),
                quant_config=vllm_config.quant_config,
                prefix="model.layers.1.block_sparse_moe",
                layer_idx=1,
            )
