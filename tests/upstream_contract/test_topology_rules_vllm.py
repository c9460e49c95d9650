"""The rules ``validate_topology`` restates from vLLM 0.33.0, held to vLLM:
its attention-head check, its vocabulary split, its pipeline layer split.
A contract with vLLM: at a vLLM bump, a failure here says what changed."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import (
    DeploymentError,
    Serving,
    Topology,
    pipeline_layers,
    validate_topology,
)
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir

TP_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 48, 64]
VOCAB = KIMI_K3_TEXT_CONFIG["vocab_size"]
HIDDEN = KIMI_K3_TEXT_CONFIG["hidden_size"]


def refused(topology: Topology, rule: str) -> bool:
    try:
        validate_topology(KIMI_K3_TEXT_CONFIG, topology)
    except DeploymentError as error:
        return rule in str(error)
    return False


@pytest.fixture(scope="module")
def model_config(kimi_model):
    from vllm.config import ModelConfig

    with tempfile.TemporaryDirectory() as directory:
        write_model_dir(
            KIMI_K3_TEXT_CONFIG,
            mxfp4.RELEASE.published_quantization_config(),
            Serving(),
            Path(directory),
        )
        yield ModelConfig(model=directory, skip_tokenizer_init=True)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_heads_as_vllm_checks_them(model_config, tp):
    from types import SimpleNamespace

    parallel = SimpleNamespace(
        enable_hc_sp=False,
        tensor_parallel_size=tp,
        enable_expert_parallel=False,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        world_size_across_dp=tp,
    )
    try:
        model_config.verify_with_parallel_config(parallel)
        vllm_refuses = False
    except ValueError as error:
        vllm_refuses = "attention heads" in str(error)
    assert refused(Topology(tp), "heads") == vllm_refuses, tp


@pytest.mark.parametrize("tp", [tp for tp in TP_SIZES if 96 % tp == 0])
def test_vocabulary_as_vllm_splits_it(kimi_model, tp):
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    try:
        with simulated_rank(Topology(tp)), torch.device("meta"):
            VocabParallelEmbedding(VOCAB, HIDDEN)
        vllm_refuses = False
    except (AssertionError, ValueError):
        vllm_refuses = True
    assert refused(Topology(tp), "vocabulary") == vllm_refuses, tp


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8, 16, 31, 32, 92, 93, 94, 120])
def test_pipeline_stages_as_vllm_splits_the_layers(kimi_model, pp):
    """``check --pp`` splits the layers without vLLM, as vLLM does."""
    from vllm.distributed.utils import get_pp_indices

    layers = KIMI_K3_TEXT_CONFIG["num_hidden_layers"]
    split = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    empty_stage = any(start == end for start, end in split)
    assert refused(Topology(1, pp_size=pp), "at least one layer") == empty_stage
    assert pipeline_layers(layers, pp) == split


@pytest.mark.parametrize(
    "experts",
    [896, 806, 672, 17],  # published, REAP10 and REAP25 pruned, a prime
)
def test_expert_parallel_placement_as_vllm_maps_experts(kimi_model, experts):
    """``check`` and ``plan`` place whole experts on each GPU as vLLM's
    ``determine_expert_map`` does (linear placement, vLLM's default), even
    or not; none is refused."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import (
        determine_expert_map,
    )

    for tp, dp in [(8, 1), (4, 2), (8, 3), (16, 2), (32, 3), (8, 8)]:
        topology = Topology(tp, dp_size=dp, expert_parallel=True)
        validate_topology({**KIMI_K3_TEXT_CONFIG, "num_experts": experts}, topology)
        ranges = topology.expert_ranges(experts)
        for gpu in range(topology.moe_group):
            count, expert_map, _ = determine_expert_map(
                topology.moe_group, gpu, experts
            )
            held = (expert_map >= 0).nonzero().flatten().tolist()
            first, end = ranges[gpu]
            assert (count, held) == (end - first, list(range(first, end)))
        assert topology.experts_per_gpu(experts) == max(
            end - first for first, end in ranges
        )
