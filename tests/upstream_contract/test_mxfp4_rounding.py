"""vLLM 0.33.0's own MXFP4 rounding, which the plugin relies on: what
``Mxfp4MoEMethod.maybe_roundup_sizes`` makes of each per-rank partition on
each kernel, and the model-level minimum vLLM alone allocates at TP32.

A contract with vLLM, not a test of the plugin: at a vLLM bump, a failure
here says what vLLM changed.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import routed_experts
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

MIN_MOE_INTERMEDIATE_PER_PARTITION = 256  # upstream's model-level minimum


@pytest.mark.parametrize(
    ("raw_local", "padded_local"), [(384, 384), (192, 256), (96, 128)]
)
def test_mxfp4_method_roundup_on_marlin(build_kimi_moe, raw_local, padded_local):
    """``Mxfp4MoEMethod.maybe_roundup_sizes`` called directly on a Marlin layer."""
    method = routed_experts(build_kimi_moe(Topology(8))).quant_method
    hidden, intermediate = method.maybe_roundup_sizes(
        k3.ROUTED_EXPERT_HIDDEN_SIZE,
        raw_local,
        torch.bfloat16,
        method.moe.moe_parallel_config,
    )
    assert (hidden, intermediate) == (k3.ROUTED_EXPERT_HIDDEN_SIZE, padded_local)


def test_upstream_tp32_allocates_model_level_minimum(build_kimi_moe):
    """The bug: upstream allocates 256 per rank where Marlin needs 128."""
    experts = routed_experts(build_kimi_moe(Topology(32), upstream=True))
    assert experts.intermediate_size_per_partition == (
        MIN_MOE_INTERMEDIATE_PER_PARTITION
    )


# Padded size of a 96-wide (TP32) partition per MXFP4 backend, from each
# kernel's stated requirement. On a CPU box ``current_platform`` is neither ROCm
# nor XPU, so ROCm-only backends take the oracle's generic branch.
RAW_96_PADDED_BY_BACKEND = [
    ("NONE", 128),  # generic fallback: multiple of 64
    ("B12X_MXFP4_MXFP8", 96),  # b12x plans for the exact model dimensions
    ("B12X_MXFP4_BF16", 96),  # b12x plans for the exact model dimensions
    ("DEEPGEMM_MXFP4", 128),  # DeepGEMM M/N/K alignment of 128
    ("FLASHINFER_TRTLLM_MXFP4_MXFP8", 128),  # TRT-LLM tiles of 128
    ("FLASHINFER_TRTLLM_MXFP4_BF16", 128),  # TRT-LLM tiles of 128
    ("FLASHINFER_CUTLASS_MXFP4_MXFP8", 128),  # FlashInfer CUTLASS tiles of 128
    ("FLASHINFER_CUTLASS_MXFP4_BF16", 128),  # FlashInfer CUTLASS tiles of 128
    ("CUTLASS_MXFP4_MXFP4", 128),  # scale tiles of 128 rows x 128 elements
    ("BATCHED_MARLIN", 128),  # Marlin: intermediate multiple of 128
    ("MARLIN", 128),  # Marlin: intermediate multiple of 128
    ("AITER_MXFP4_BF16", 128),  # ROCm-only; off ROCm: multiple of 64
    ("AITER_TRITON_MXFP4_BF16", 128),  # ROCm-only; off ROCm: multiple of 64
    ("AITER_MXFP4_FP8", 128),  # ROCm-only; off ROCm: multiple of 64
    ("AITER_MXFP4_MXFP4", 128),  # ROCm-only; off ROCm: multiple of 64
    ("AITER_TRITON_MXFP4_MXFP4", 128),  # ROCm-only; off ROCm: multiple of 64
    ("TRITON", 128),  # triton matmul_ogs off ROCm: multiple of 64
    ("TRITON_UNFUSED", 128),  # triton matmul_ogs off ROCm: multiple of 64
    ("XPU", 128),  # off XPU: generic multiple of 64
    ("CPU", 96),  # CPU AMX kernel BLOCK_N = 32
    ("EMULATION", 96),  # OCP MX block alignment of 32 only
    ("HUMMING", 128),  # Humming: generic multiple of 64
    ("FLASHINFER_MOE_EP_CUTEDSL", 96),  # megakernel validates the model dims
    ("FLASHINFER_MOE_EP_DEEP_GEMM", 96),  # megakernel validates the model dims
]


def test_raw_96_matrix_names_every_backend():
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    assert sorted(name for name, _ in RAW_96_PADDED_BY_BACKEND) == sorted(
        backend.name for backend in Mxfp4MoeBackend
    )


@pytest.mark.parametrize(("backend_name", "padded"), RAW_96_PADDED_BY_BACKEND)
def test_raw_96_partition_per_backend(build_kimi_moe, backend_name, padded):
    """The raw partition a patched TP32 layer hands its quantization method,
    padded by ``Mxfp4MoEMethod.maybe_roundup_sizes`` as each backend would."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    experts = routed_experts(build_kimi_moe(Topology(32)))
    moe_config, method = experts.moe_config, experts.quant_method
    raw_local = moe_config.intermediate_size // moe_config.moe_parallel_config.tp_size
    assert raw_local == 96
    # Which backend runs is the platform's choice; the tests make it.
    method.mxfp4_backend = Mxfp4MoeBackend[backend_name]
    _, intermediate = method.maybe_roundup_sizes(
        k3.ROUTED_EXPERT_HIDDEN_SIZE,
        raw_local,
        moe_config.in_dtype,
        moe_config.moe_parallel_config,
    )
    assert intermediate == padded
