"""On vLLM's compressed-tensors MXFP4 MoE method, Kimi-K3's per-rank partition is
padded for the Marlin kernel, the pad is zero, and aligned layers are untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import POISON, routed_experts
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

CT = "ct-mxfp4"
HIDDEN = k3.ROUTED_EXPERT_HIDDEN_SIZE  # 3584
EXPERTS = k3.NUM_EXPERTS  # 896
MARLIN_MXFP4_GROUP = 32
CT_METHOD = "CompressedTensorsW4A4Mxfp4MoEMethod"


@pytest.mark.parametrize(
    ("tp_size", "raw_local", "padded_local"),
    [
        (8, 384, 384),  # 3072 // 8: already a multiple of 128
        (16, 192, 256),  # 3072 // 16 == 192 -> pad to 256
        (32, 96, 128),  # 3072 // 32 == 96 -> pad to 128
    ],
)
def test_partition_is_padded_for_marlin(
    build_kimi_moe, tp_size, raw_local, padded_local
):
    experts = routed_experts(build_kimi_moe(Topology(tp_size), quantization=CT))
    assert type(experts.quant_method).__name__ == CT_METHOD
    assert experts.moe_config.intermediate_size_per_partition_unpadded == raw_local
    assert experts.intermediate_size_per_partition == padded_local
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters()}
    assert shapes["w13_weight_packed"] == (EXPERTS, 2 * padded_local, HIDDEN // 2)
    assert shapes["w13_weight_scale"] == (EXPERTS, 2 * padded_local, HIDDEN // 32)
    assert shapes["w2_weight_packed"] == (EXPERTS, HIDDEN, padded_local // 2)
    assert shapes["w2_weight_scale"] == (EXPERTS, HIDDEN, padded_local // 32)


@pytest.mark.parametrize("tp_size", [16, 32])
def test_upstream_allocates_the_model_level_256(build_kimi_moe, tp_size):
    upstream = routed_experts(
        build_kimi_moe(Topology(tp_size), upstream=True, quantization=CT)
    )
    assert upstream.intermediate_size_per_partition == 256


def marlin_accepts(experts, intermediate_per_partition: int) -> bool:
    """vLLM's own fused-MoE Marlin shape check (gate-up ``2 * I % 128``, down
    ``I % 64``, hidden ``% 128``), asked about a given per-rank intermediate."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        check_moe_marlin_supports_config,
    )

    config = copy.copy(experts.moe_config)
    config.intermediate_size_per_partition_unpadded = intermediate_per_partition
    return check_moe_marlin_supports_config(config, MARLIN_MXFP4_GROUP)


@pytest.mark.parametrize(("tp_size", "raw_local"), [(8, 384), (16, 192), (32, 96)])
def test_marlin_shape_check_holds_for_the_allocated_partition(
    build_kimi_moe, tp_size, raw_local
):
    experts = routed_experts(build_kimi_moe(Topology(tp_size), quantization=CT))
    allocated = experts.w2_weight_packed.shape[2] * k3.MXFP4_VALUES_PER_BYTE
    assert marlin_accepts(experts, allocated)
    assert experts.w13_weight_packed.shape[1] == 2 * allocated
    # The check has teeth: TP32's raw 96 fails it (96 % 64 != 0).
    assert marlin_accepts(experts, raw_local) == (raw_local % 64 == 0)


@pytest.mark.parametrize(
    ("tp_size", "raw_local", "padded_local"), [(16, 192, 256), (32, 96, 128)]
)
def test_padding_is_zero_at_construction(
    build_kimi_moe, uninitialised_memory_is_visible, tp_size, raw_local, padded_local
):
    experts = routed_experts(
        build_kimi_moe(Topology(tp_size), small=True, device="cpu", quantization=CT)
    )
    for suffix in ("weight_packed", "weight_scale"):
        w13 = getattr(experts, f"w13_{suffix}")
        assert w13.shape[1] == 2 * padded_local
        assert not w13[:, raw_local:padded_local].any()
        assert not w13[:, padded_local + raw_local :].any()
    per_byte = {"weight_packed": k3.MXFP4_VALUES_PER_BYTE, "weight_scale": 32}
    for suffix, values in per_byte.items():
        w2 = getattr(experts, f"w2_{suffix}")
        assert w2.shape[2] == padded_local // values
        assert not w2[..., raw_local // values :].any()


def test_aligned_partition_keeps_upstream_allocation(
    build_kimi_moe, uninitialised_memory_is_visible
):
    """TP8 (384 per rank) needs no padding: same shapes as upstream, and the
    allocation is left as upstream's ``torch.empty`` made it."""
    patched = routed_experts(
        build_kimi_moe(Topology(8), small=True, device="cpu", quantization=CT)
    )
    upstream = routed_experts(
        build_kimi_moe(
            Topology(8), upstream=True, small=True, device="cpu", quantization=CT
        )
    )
    mine = {n: p for n, p in patched.named_parameters()}
    theirs = {n: p for n, p in upstream.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in mine.items()} == {
        n: (p.shape, p.dtype) for n, p in theirs.items()
    }
    assert bool((mine["w2_weight_packed"] == POISON).all())


def test_expert_parallel_keeps_upstream_allocation(build_kimi_moe):
    topology = Rank(Topology(32, expert_parallel=True), tp_rank=31)
    patched = routed_experts(build_kimi_moe(topology, quantization=CT))
    upstream = routed_experts(build_kimi_moe(topology, upstream=True, quantization=CT))
    assert {n: p.shape for n, p in patched.named_parameters()} == {
        n: p.shape for n, p in upstream.named_parameters()
    }
    assert patched.w2_weight_packed.shape == (28, HIDDEN, 3072 // 2)


def test_rounding_is_confined_to_kimi_k3_layers(build_kimi_moe):
    """The same method object, asked outside a ``KimiMoE`` build (as for any
    other model), answers as upstream does: no rounding."""
    experts = routed_experts(build_kimi_moe(Topology(32), quantization=CT))
    method = experts.quant_method
    assert method.maybe_roundup_sizes(
        HIDDEN, 96, torch.bfloat16, experts.moe_config.moe_parallel_config
    ) == (HIDDEN, 96)
