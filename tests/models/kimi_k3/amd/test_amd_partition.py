"""On ROCm and XPU, vLLM's AMD Kimi-K3 MoE with the plugin builds at every layout, each
GPU holding the rows its MXFP4 backend needs: where vLLM alone raises (every
tensor-parallel size of 16 or more) and identically where it builds.

vLLM alone's ``KimiMoE`` (``amd/linear.py``) pads to 256 rows per TP GPU
when ``3072 // tp < 256`` and then looks up ``w13_weight_packed`` on its MoE
runner: ``AttributeError``. With the plugin the backend vLLM selects rounds
the logical slice itself (``mxfp4_round_up_hidden_size_and_intermediate_size``):
emulation (CDNA3's default) to 32 rows, AITER's SiTU kernel (CDNA4) to 128;
with expert parallelism each GPU holds whole 3072-row experts.
"""

from __future__ import annotations

import pytest

from tests.models.kimi_k3.amd.conftest import build_amd_kimi_moe
from tests.models.kimi_k3.builders import routed_experts
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading import (
    expert_loading,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

MOE_INTERMEDIATE = 3072
EXPERTS = 896
EMULATION = "EMULATION"
AITER = "AITER_MXFP4_BF16"

# layout, GPU -> (backend, rows allocated, rows held (the raw slice: what
# vLLM's loader writes and what AITER's experts read as unpadded), experts)
CASES = [
    # vLLM alone builds these (it pads nothing at TP8): the same layer
    (Topology(8), "cdna3", EMULATION, 384, 384, EXPERTS),
    (Topology(8), "cdna4-aiter", AITER, 384, 384, EXPERTS),
    (Topology(8, dp_size=2), "cdna3", EMULATION, 192, 192, EXPERTS),  # 3072 / 16
    (Topology(8, dp_size=2), "cdna4-aiter", AITER, 256, 192, EXPERTS),  # 192 -> 128s
    # vLLM alone raises on these
    (Topology(16), "cdna3", EMULATION, 192, 192, EXPERTS),
    (Topology(16), "cdna4-aiter", AITER, 256, 192, EXPERTS),
    (Topology(32), "cdna3", EMULATION, 96, 96, EXPERTS),
    (Topology(32), "cdna4-aiter", AITER, 128, 96, EXPERTS),
    (Topology(16, dp_size=2), "cdna3", EMULATION, 96, 96, EXPERTS),  # 32 GPUs
    (Topology(16, dp_size=2), "cdna4-aiter", AITER, 128, 96, EXPERTS),
    # expert parallelism: whole experts, 896 / 16 and 896 / 32 per GPU
    (Topology(16, expert_parallel=True), "cdna3", EMULATION, 3072, 3072, 56),
    (Topology(16, expert_parallel=True), "cdna4-aiter", AITER, 3072, 3072, 56),
    (Topology(32, expert_parallel=True), "cdna3", EMULATION, 3072, 3072, 28),
    (Topology(32, expert_parallel=True), "cdna4-aiter", AITER, 3072, 3072, 28),
    # Intel's XPU builds the same AMD model (--moe-backend emulation)
    (Topology(8), "xpu", EMULATION, 384, 384, EXPERTS),
    (Topology(32), "xpu", EMULATION, 96, 96, EXPERTS),
]
# vLLM alone pads (and raises) where 3072 // tp < 256 (its minimum): TP16 up
MIN_ROWS_PER_TP_GPU = 256


def _id(case: tuple) -> str:
    return f"{case[0].label().replace(' ', '')}-{case[1]}"


def _layout(experts) -> tuple:
    config = experts.moe_config
    shapes = sorted((n, tuple(p.shape)) for n, p in experts.named_parameters())
    return (
        type(experts.quant_method).__name__,
        experts.quant_method.mxfp4_backend.value,
        config.intermediate_size_per_partition,
        config.intermediate_size_per_partition_unpadded,
        shapes,
    )


@pytest.mark.parametrize(
    ("topology", "gpu", "backend", "rows", "held", "experts"),
    CASES,
    ids=[_id(c) for c in CASES],
)
def test_each_gpu_gets_its_backends_rows(
    amd_model, topology, gpu, backend, rows, held, experts
):
    moe = build_amd_kimi_moe(amd_model, gpu, topology)
    layer = routed_experts(moe)
    config = layer.moe_config
    assert layer.quant_method.mxfp4_backend.value == backend
    assert config.intermediate_size == MOE_INTERMEDIATE
    assert config.intermediate_size_per_partition == rows
    # AITER masks per_partition - unpadded rows of every expert: the pad
    assert config.intermediate_size_per_partition_unpadded == held
    assert layer.local_num_experts == experts
    # MXFP4 packs two values a byte: w13 holds gate and up, rows each
    assert tuple(layer.w13_weight.shape[:2]) == (experts, 2 * rows)
    assert tuple(layer.w2_weight.shape[:2]) == (experts, moe.moe_hidden_size)
    assert layer.w2_weight.shape[2] * 2 == rows
    assert expert_loading(layer) is not None  # strict loading on

    if MOE_INTERMEDIATE // topology.tp_size >= MIN_ROWS_PER_TP_GPU:
        alone = build_amd_kimi_moe(amd_model, gpu, topology, upstream=True)
        assert _layout(routed_experts(alone)) == _layout(layer)
    else:
        with pytest.raises(AttributeError, match="w13_weight_packed"):
            build_amd_kimi_moe(amd_model, gpu, topology, upstream=True)
