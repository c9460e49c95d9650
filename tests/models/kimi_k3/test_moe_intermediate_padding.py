"""Regular Kimi-K3 FusedMoE gets the logical size; the MXFP4 backend pads per rank."""

from __future__ import annotations

import sys
from typing import ClassVar

import pytest
import torch
from torch import nn

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import routed_experts
from vllm_kimi_k3_moe.tools.build.rank import Topology

MIN_MOE_INTERMEDIATE_PER_PARTITION = 256  # upstream's model-level minimum
MXFP4_MARLIN_ALIGNMENT = 128  # Marlin MXFP4 MoE: intermediate multiple of 128


@pytest.mark.parametrize("tp_size", [8, 16, 32])
def test_regular_factory_receives_logical_size(build_kimi_moe, tp_size):
    moe = build_kimi_moe(Topology(tp_size))
    # FusedMoEConfig.intermediate_size is the factory's intermediate_size
    # argument, stored verbatim by vLLM's FusedMoEFactory.
    assert routed_experts(moe).moe_config.intermediate_size == 3072


@pytest.mark.parametrize(
    ("tp_size", "model_level"),
    [
        (8, 3072),  # 3072 // 8 == 384 >= 256: no model-level padding
        (16, 4096),  # 3072 // 16 == 192 < 256 -> 256 * 16
        (32, 8192),  # 3072 // 32 == 96 < 256 -> 256 * 32
    ],
)
def test_model_level_padded_size_is_kept(build_kimi_moe, tp_size, model_level):
    assert build_kimi_moe(Topology(tp_size)).padded_moe_intermediate_size == (
        model_level
    )


@pytest.mark.parametrize(
    ("tp_size", "model_level"), [(8, 3072), (16, 4096), (32, 8192)]
)
def test_upstream_regular_factory_receives_model_level_size(
    build_kimi_moe, tp_size, model_level
):
    """The baseline the fix is measured against: upstream 0.33.0 itself."""
    moe = build_kimi_moe(Topology(tp_size), upstream=True)
    assert routed_experts(moe).moe_config.intermediate_size == model_level


def _calls_from_kimi_model(frame) -> bool:
    return frame.f_code.co_filename.replace("\\", "/").endswith(
        "vllm/models/kimi_k3/nvidia/model.py"
    )


@pytest.fixture
def model_level_writes(monkeypatch):
    """Record ``zero_()`` calls and ``intermediate_size_per_partition_unpadded``
    assignments made by code in vLLM's Kimi-K3 NVIDIA model file (spies: both
    still do what they did)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    writes: list[str] = []
    zero_ = torch.Tensor.zero_
    setattr_ = FusedMoEConfig.__setattr__

    def spy_zero_(tensor, *args, **kwargs):
        if _calls_from_kimi_model(sys._getframe(1)):
            writes.append(f"zero_ of a {tuple(tensor.shape)} tensor")
        return zero_(tensor, *args, **kwargs)

    def spy_setattr(config, name, value):
        if name == "intermediate_size_per_partition_unpadded" and (
            _calls_from_kimi_model(sys._getframe(1))
        ):
            writes.append(f"{name} = {value}")
        return setattr_(config, name, value)

    monkeypatch.setattr(torch.Tensor, "zero_", spy_zero_)
    monkeypatch.setattr(FusedMoEConfig, "__setattr__", spy_setattr)
    return writes


@pytest.mark.parametrize("tp_size", [8, 16, 32])
def test_no_model_level_zeroing_or_fixup(build_kimi_moe, model_level_writes, tp_size):
    build_kimi_moe(Topology(tp_size))
    assert model_level_writes == []


def test_spies_see_upstream_fixup(build_kimi_moe, model_level_writes):
    """The spies work: unpatched upstream at TP32 assigns the fixup."""
    build_kimi_moe(Topology(32), upstream=True)
    assert "intermediate_size_per_partition_unpadded = 96" in model_level_writes


@pytest.mark.parametrize(
    ("tp_size", "raw_local", "padded_local"),
    [
        (8, 384, 384),  # 384 is already a multiple of 128
        (16, 192, 256),  # 192 -> next multiple of 128
        (32, 96, 128),  # 96 -> next multiple of 128
    ],
)
def test_marlin_pads_each_rank_partition(
    build_kimi_moe, tp_size, raw_local, padded_local
):
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    experts = routed_experts(build_kimi_moe(Topology(tp_size)))
    assert experts.quant_method.mxfp4_backend == Mxfp4MoeBackend.MARLIN
    assert experts.moe_config.intermediate_size_per_partition_unpadded == raw_local
    assert experts.intermediate_size_per_partition == padded_local

    hidden = k3.ROUTED_EXPERT_HIDDEN_SIZE  # 3584 = 14 * 256: no hidden padding
    e = k3.NUM_EXPERTS
    shapes = {
        n: tuple(p.shape)
        for n, p in experts.named_parameters()
        if n.startswith(("w13_", "w2_"))
    }
    assert shapes == {
        "w13_weight": (e, 2 * padded_local, hidden // 2),
        "w13_weight_scale": (e, 2 * padded_local, hidden // 32),
        "w2_weight": (e, hidden, padded_local // 2),
        "w2_weight_scale": (e, hidden, padded_local // 32),
    }
    assert {experts.get_parameter(n).dtype for n in shapes} == {torch.uint8}


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


class FactoryStandIn(nn.Module):
    """Installed as the model module's ``FusedMoEFactory`` after the plugin has
    applied (a profiler, another plugin, a test double): records what
    ``KimiMoE`` hands it and builds nothing."""

    calls: ClassVar[list[dict]] = []

    def __init__(self, **kwargs) -> None:
        super().__init__()
        FactoryStandIn.calls.append(kwargs)


@pytest.mark.parametrize(("tp_size", "model_level"), [(16, 4096), (32, 8192)])
def test_fix_survives_a_rebound_factory(
    kimi_model, build_kimi_moe, model_level_writes, monkeypatch, tp_size, model_level
):
    monkeypatch.setattr(FactoryStandIn, "calls", [])
    monkeypatch.setattr(kimi_model, "FusedMoEFactory", FactoryStandIn)
    moe = build_kimi_moe(Topology(tp_size))
    assert isinstance(moe.experts, FactoryStandIn)
    ((call,),) = [FactoryStandIn.calls]
    assert call["intermediate_size"] == 3072
    assert moe.padded_moe_intermediate_size == model_level
    assert model_level_writes == []  # no intermediate_size_per_partition_unpadded
