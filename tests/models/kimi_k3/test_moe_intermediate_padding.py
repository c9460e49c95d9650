"""Regular Kimi-K3 FusedMoE gets the logical size; the MXFP4 backend pads per rank."""

from __future__ import annotations

import sys
from typing import ClassVar

import pytest
import torch
from torch import nn

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import routed_experts
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

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
