"""``validate_topology`` (what ``plan`` and ``check`` refuse up front) refuses
exactly the MoE shardings vLLM 0.33.0, with the plugin, cannot build: rank 0
of each, in every published format and the integer groups of 128, built by
vLLM's own layers."""

from __future__ import annotations

import pytest

from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import (
    DeploymentError,
    Topology,
    validate_topology,
)
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

# Without expert parallelism, 8 to 256 GPUs sharing every expert, with and
# without vLLM's model-level padding (TP16 and up): where a GPU's even
# slice splits a scale group (FP8 blocks and INT groups of 128 at 96 or 192
# rows, MXFP4 blocks of 32 at 48 or 24) it holds whole groups instead; only
# a split of 3072 rows that is not even is refused.
TOPOLOGIES = [
    Topology(tp, dp_size=dp)
    for tp, dp in [
        (8, 1), (16, 1), (32, 1),  # 384, 192, 96 rows per GPU
        (1, 8), (2, 4), (4, 2),  # 384
        (8, 2), (4, 4), (2, 8), (1, 16),  # 192, no model-level padding
        (8, 4), (4, 8), (1, 32),  # 96, none
        (16, 2),  # 96, padded at model level
        (32, 2), (8, 8), (32, 8),  # 48, 48, 12
        (8, 5), (1, 7), (32, 3),  # 40, 7, 96 GPUs: 3072 rows do not split evenly
    ]
]  # fmt: skip
FORMATS = {
    "mxfp4": "marlin",
    "ct-mxfp4": "marlin",
    "fp8-block": "triton",
    "nvfp4": "flashinfer_cutedsl",
    "modelopt-nvfp4": "marlin",
    "w4a16": "marlin",
    "ct-int4-g128-asym": "marlin",
    "awq": "marlin",
    "gptq": "marlin",
    "bf16": "triton",
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_refused_exactly_where_vllm_cannot_build(format_experts, fmt):
    for topology in TOPOLOGIES:
        try:
            validate_topology(KIMI_K3_TEXT_CONFIG, topology)
            refusal = None
        except DeploymentError as error:
            refusal = str(error)
        try:
            format_experts(fmt, FORMATS[fmt], topology)
            built = None
        except (AssertionError, ValueError) as error:
            built = f"{type(error).__name__}: {error}"
        assert (refusal is None) == (built is None), (topology.label(), refusal, built)


# Expert parallelism over GPU counts that do not divide 896: vLLM builds each
# (``determine_expert_map``), the first 896 % GPUs of them one expert heavier.
UNEVEN_EXPERT_PARALLEL = [
    Topology(8, dp_size=3, expert_parallel=True),  # 24 GPUs: 37 each, 8 get 38
    Topology(32, dp_size=3, expert_parallel=True),  # 96 GPUs: 9 each, 32 get 10
]


@pytest.mark.parametrize("topology", UNEVEN_EXPERT_PARALLEL, ids=Topology.label)
def test_uneven_expert_parallel_splits_are_built_as_vllm_places_them(
    format_experts, topology
):
    """Not refused, and every GPU holds the experts ``expert_ranges`` says,
    as vLLM's built layer maps them (its expert map: global to local)."""
    validate_topology(KIMI_K3_TEXT_CONFIG, topology)
    ranges = topology.expert_ranges(KIMI_K3_TEXT_CONFIG["num_experts"])
    assert ranges[0][1] - ranges[0][0] == topology.experts_per_gpu(896)
    for tp_rank, dp_rank in [(0, 0), (topology.tp_size - 1, topology.dp_size - 1)]:
        experts = format_experts(
            "mxfp4", "marlin", Rank(topology, tp_rank=tp_rank, dp_rank=dp_rank)
        )
        first, end = ranges[dp_rank * topology.tp_size + tp_rank]
        held = (experts.expert_map >= 0).nonzero().flatten().tolist()
        assert held == list(range(first, end))
        assert experts.local_num_experts == end - first
