"""A deployment's topology: its name wherever it is printed, each GPU's share
of Kimi-K3's routed experts, and the uneven splits refused (no vLLM needed)."""

from __future__ import annotations

import pytest

from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Topology,
    validate,
)

INTERMEDIATE = 3072  # Kimi-K3's moe_intermediate_size
NUM_EXPERTS = 896


@pytest.mark.parametrize(
    ("topology", "short", "product", "sentence"),
    [
        (Topology(32), "TP32", "TP 32 x DP 1", "TP32 without"),
        (Topology(8, dp_size=4), "TP8 DP4", "TP 8 x DP 4", "TP8 x DP4 without"),
        (
            Topology(32, dp_size=1, expert_parallel=True),
            "TP32 EP",
            "TP 32 x DP 1",
            "TP32 with",
        ),
        (
            Topology(8, dp_size=4, expert_parallel=True),
            "TP8 DP4 EP",
            "TP 8 x DP 4",
            "TP8 x DP4 with",
        ),
        # DCP adds no GPU: it follows the TP size it splits, not in the count
        (Topology(8, dcp_size=8), "TP8 DCP8", "TP 8 x DP 1", "TP8 DCP8 without"),
        (
            Topology(8, pp_size=2, dp_size=2, dcp_size=4),
            "TP8 DCP4 PP2 DP2",
            "TP 8 x PP 2 x DP 2",
            "TP8 DCP4 x PP2 x DP2 without",
        ),
    ],
)
def test_label_styles(topology, short, product, sentence) -> None:
    assert topology.label() == short
    assert topology.label("product") == product
    assert topology.label("sentence") == f"{sentence} expert parallelism"


def test_a_deployment_is_named_by_its_topology() -> None:
    deployment = Deployment(8, dp_size=4, expert_parallel=True, backend="triton")
    assert deployment.label() == "TP8 DP4 EP"
    assert deployment.gpus == 32


@pytest.mark.parametrize(
    ("topology", "experts", "intermediate"),
    [
        (Topology(8), NUM_EXPERTS, 384),
        (Topology(32), NUM_EXPERTS, 96),  # 3072 // 32
        (Topology(8, dp_size=4), NUM_EXPERTS, 96),  # DP without EP shards over 32 GPUs
        (
            Topology(32, dp_size=1, expert_parallel=True),
            28,
            INTERMEDIATE,
        ),  # 896 // 32 whole experts
        (Topology(4, dp_size=2, expert_parallel=True), 112, INTERMEDIATE),
        # 896 = 37 x 24 + 8: vLLM gives GPUs 0-7 one more, GPU 0 the heaviest
        (Topology(8, dp_size=3, expert_parallel=True), 38, INTERMEDIATE),
    ],
)
def test_each_gpus_share(topology, experts, intermediate) -> None:
    assert topology.experts_per_gpu(NUM_EXPERTS) == experts
    assert topology.intermediate_per_gpu(INTERMEDIATE) == intermediate


@pytest.mark.parametrize(
    ("deployment", "words"),
    [
        (Deployment(0), ["at least 1", "TP 0"]),
        (Deployment(7), ["3072", "7 GPUs (TP 7 x DP 1)"]),
        (Deployment(32, backend="auto"), ["resolved by vLLM"]),
        (Deployment(32, quantization="fp4"), ["'fp4'"]),
        (Deployment(8, dcp_size=16), ["decode-context-parallel size 16", "TP"]),
        (Deployment(8, dcp_size=0), ["decode-context-parallel size must be"]),
    ],
)
def test_what_cannot_be_sized_is_refused(deployment, words) -> None:
    with pytest.raises(DeploymentError) as refused:
        validate(KIMI_K3_MOE_FIELDS, deployment)
    assert "\n" not in str(refused.value)
    for word in words:
        assert word in str(refused.value)
