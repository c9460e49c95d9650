"""A Kimi-K3-format checkpoint, loaded as vLLM loads it, split over simulated ranks.

The generated checkpoint (``kimi_k3_checkpoint``) goes through vLLM's own
handling end to end: ``ModelConfig`` reads its ``config.json`` (and rewrites
compressed-tensors ``mxfp4-pack-quantized`` to native MXFP4), ``VllmConfig``
resolves the quantization, the real ``KimiMoE`` layers are built for every
rank, ``DefaultModelLoader`` streams the shards, and ``AutoWeightsLoader`` with
Kimi-K3's mapper hands the expert tensors to ``KimiLinearModel.load_weights``,
whose expert name mapping calls each rank's ``weight_loader``. Reassembling the
valid regions of all ranks must give back every checkpoint tensor bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import routed_experts
from tests.models.kimi_k3.kimi_k3_checkpoint import (
    PROJECTIONS,
    SUFFIXES,
    KimiK3Spec,
    expert_tensor_name,
    write_checkpoint,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading import (
    expert_loading,
)
from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

SPEC = KimiK3Spec()
INTERMEDIATE = SPEC.moe_intermediate_size
# The MoE part of each checkpoint tensor name; the stand-in model has nothing
# else (the MTP layer's experts are left to the MTP model, as vLLM does).
ROUTED_EXPERTS = ".block_sparse_moe.experts."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("kimi-k3-tiny")
    shards = write_checkpoint(directory, SPEC)
    return directory, {name: t for shard in shards for name, t in shard.items()}


@pytest.fixture(scope="module")
def model_config(kimi_model, checkpoint):
    """vLLM's ``ModelConfig`` of the generated checkpoint."""
    from vllm.config import ModelConfig

    return ModelConfig(model=str(checkpoint[0]), skip_tokenizer_init=True)


def load_rank(
    topology: Rank | Topology,
    model_dir: Path,
    rank_config,
    moe_layers_only_model,
    kimi_moe_cls: type,
) -> dict[int, nn.Module]:
    """Build ``topology``'s rank and load the checkpoint into it, as vLLM's
    default loader does; its ``RoutedExperts`` by layer index."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    vllm_config = rank_config(topology, model_dir=model_dir)
    model = moe_layers_only_model(vllm_config, kimi_moe_cls)
    weights = DefaultModelLoader(LoadConfig()).get_all_weights(
        vllm_config.model_config, model
    )
    AutoWeightsLoader(model).load_weights(
        ((name, w) for name, w in weights if ROUTED_EXPERTS in name),
        mapper=KimiK3ForConditionalGeneration.hf_to_vllm_mapper,
    )
    layers = model.language_model.model.layers
    return {i: routed_experts(layers[i].block_sparse_moe) for i in SPEC.main_moe_layers}


def test_vllm_resolves_the_checkpoint_to_native_mxfp4(
    checkpoint, model_config, rank_config
) -> None:
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

    written = json.loads((checkpoint[0] / "config.json").read_text())
    assert written["quantization_config"]["quant_method"] == "compressed-tensors"
    assert model_config.hf_config.model_type == "kimi_k3"
    # vLLM's Kimi-K3 config hook rewrote mxfp4-pack-quantized to native MXFP4
    assert model_config.hf_config.quantization_config["quant_method"] == "mxfp4"
    assert model_config.quantization == "mxfp4"
    text_config = model_config.hf_text_config
    assert text_config.moe_intermediate_size == INTERMEDIATE
    assert text_config.num_experts == SPEC.num_experts
    vllm_config = rank_config(Topology(32), model_dir=checkpoint[0])
    assert type(vllm_config.quant_config) is Mxfp4Config


# The checkpoint tensors of one expert, as "{projection}.{suffix}".
EXPERT_TENSORS = tuple(
    f"{projection}.{suffix}" for projection in PROJECTIONS for suffix in SUFFIXES
)


def padded_rows(experts: nn.Module) -> int:
    """Intermediate rows each of gate and up takes in ``w13``, padding included."""
    return experts.w13_weight.shape[1] // 2


def valid_region(tensor: str, per_rank: int, padded: int) -> tuple[str, tuple]:
    """Where a rank's share of an expert's checkpoint tensor sits: the expert
    parameter, and the index into one expert of it. ``w13`` stacks the gate
    rows ``[0, padded)`` over the up rows ``[padded, 2 padded)``; ``w2`` and
    its scale carry the intermediate along the last dimension, packed two
    values per byte or one scale per 32 values."""
    projection, suffix = tensor.split(".")
    parameter = f"{'w2' if projection == 'w2' else 'w13'}_weight" + (
        "_scale" if suffix == "weight_scale" else ""
    )
    if projection == "w2":
        per_byte = (
            k3.MXFP4_BLOCK if suffix == "weight_scale" else k3.MXFP4_VALUES_PER_BYTE
        )
        return parameter, (slice(None), slice(0, per_rank // per_byte))
    start = padded if projection == "w3" else 0
    return parameter, (slice(start, start + per_rank),)


def padded_tails(experts: nn.Module, per_rank: int) -> list[torch.Tensor]:
    """Every byte of a rank's expert parameters outside its valid regions."""
    padded = padded_rows(experts)
    return [
        experts.w13_weight[:, per_rank:padded],
        experts.w13_weight[:, padded + per_rank :],
        experts.w13_weight_scale[:, per_rank:padded],
        experts.w13_weight_scale[:, padded + per_rank :],
        experts.w2_weight[:, :, per_rank // k3.MXFP4_VALUES_PER_BYTE :],
        experts.w2_weight_scale[:, :, per_rank // k3.MXFP4_BLOCK :],
    ]


def reassemble_tp(
    ranks: list[dict[int, nn.Module]], layer: int, expert: int, tensor: str
) -> torch.Tensor:
    """One checkpoint tensor put back together from the valid regions of all
    TP ranks, in rank order: w1/w3 along their rows, w2 along its columns."""
    pieces = []
    for rank in ranks:
        experts = rank[layer]
        padded = padded_rows(experts)
        parameter, index = valid_region(tensor, INTERMEDIATE // len(ranks), padded)
        pieces.append(getattr(experts, parameter)[expert][index])
    return torch.cat(pieces, dim=1 if tensor.startswith("w2") else 0)


def reassemble_ep(
    ranks: list[dict[int, nn.Module]], layer: int, expert: int, tensor: str
) -> torch.Tensor:
    """One checkpoint tensor from the rank holding its expert: vLLM's linear
    placement puts experts [r k, (r + 1) k) on EP rank r."""
    per_rank = SPEC.num_experts // len(ranks)
    experts = ranks[expert // per_rank][layer]
    parameter, index = valid_region(tensor, INTERMEDIATE, padded_rows(experts))
    return getattr(experts, parameter)[expert % per_rank][index]


def assert_reassembles_bit_for_bit(reassemble, checkpoint_tensors: dict) -> None:
    compared = 0
    for layer in SPEC.main_moe_layers:
        for expert in range(SPEC.num_experts):
            for tensor in EXPERT_TENSORS:
                projection, suffix = tensor.split(".")
                name = expert_tensor_name(layer, expert, projection, suffix)
                expected = checkpoint_tensors[name]
                actual = reassemble(layer, expert, tensor)
                assert actual.dtype == expected.dtype, name
                assert torch.equal(actual, expected), f"{name} differs"
                compared += 1
    assert compared == len(SPEC.main_moe_layers) * SPEC.num_experts * 6


@pytest.fixture
def load_ranks(kimi_model, checkpoint, rank_config, moe_layers_only_model):
    """Load the checkpoint into every rank of a deployment (patched
    ``KimiMoE`` unless ``upstream``); each rank's experts by layer."""

    def load(
        tp_size: int, *, expert_parallel: bool = False, upstream: bool = False
    ) -> list[dict[int, nn.Module]]:
        cls = upstream_class(kimi_model.KimiMoE) if upstream else kimi_model.KimiMoE
        return [
            load_rank(
                Rank(Topology(tp_size, expert_parallel=expert_parallel), tp_rank=rank),
                checkpoint[0],
                rank_config,
                moe_layers_only_model,
                cls,
            )
            for rank in range(tp_size)
        ]

    return load


@pytest.mark.parametrize(
    ("tp_size", "padded"),
    [(8, 384), (16, 256), (32, 128)],  # Marlin: 384, 192 -> 256, 96 -> 128
)
def test_tp_ranks_reassemble_the_checkpoint_bit_for_bit(
    tp_size, padded, load_ranks, checkpoint
) -> None:
    ranks = load_ranks(tp_size)
    per_rank = INTERMEDIATE // tp_size
    for rank in ranks:
        for experts in rank.values():
            assert experts.intermediate_size_per_partition == padded
            assert experts.w13_weight.shape == (
                SPEC.num_experts,
                2 * padded,
                SPEC.routed_expert_hidden_size // k3.MXFP4_VALUES_PER_BYTE,
            )
            assert expert_loading(experts).missing() == []
            for tail in padded_tails(experts, per_rank):
                assert torch.count_nonzero(tail) == 0
    assert_reassembles_bit_for_bit(
        lambda layer, expert, tensor: reassemble_tp(ranks, layer, expert, tensor),
        checkpoint[1],
    )


@pytest.mark.parametrize("ep_size", [4, 8])
def test_expert_parallel_ranks_reassemble_the_checkpoint_bit_for_bit(
    ep_size, load_ranks, checkpoint
) -> None:
    ranks = load_ranks(ep_size, expert_parallel=True)
    for rank in ranks:
        for experts in rank.values():
            assert experts.local_num_experts == SPEC.num_experts // ep_size
            assert (
                experts.intermediate_size_per_partition == INTERMEDIATE
            )  # unsplit, unpadded
            assert expert_loading(experts).missing() == []
    assert_reassembles_bit_for_bit(
        lambda layer, expert, tensor: reassemble_ep(ranks, layer, expert, tensor),
        checkpoint[1],
    )


@pytest.mark.parametrize(
    ("tp_size", "upstream_padded"),
    [(8, 384), (16, 256), (32, 256)],  # vLLM 0.33.0: at least 256 per TP rank
)
def test_without_the_plugin_the_same_load_allocates_upstreams_sizes(
    tp_size, upstream_padded, load_ranks, checkpoint
) -> None:
    ranks = load_ranks(tp_size, upstream=True)
    for rank in ranks:
        for experts in rank.values():
            assert expert_loading(experts) is None  # no plugin in this layer
            assert experts.intermediate_size_per_partition == upstream_padded
            assert experts.w13_weight.shape[1] == 2 * upstream_padded
    # upstream puts the same bytes in the same valid regions, in more memory
    assert_reassembles_bit_for_bit(
        lambda layer, expert, tensor: reassemble_tp(ranks, layer, expert, tensor),
        checkpoint[1],
    )


@pytest.mark.parametrize(
    ("projection", "suffix"), [("w1", "weight_packed"), ("w2", "weight_scale")]
)
def test_mis_shaped_tensor_is_named_as_the_checkpoint_names_it(
    tmp_path, kimi_model, rank_config, moe_layers_only_model, projection, suffix
) -> None:
    """vLLM renames the tensor twice on its way to the expert loader
    (``language_model.model.layers``, native MXFP4's ``.weight``); the error
    names the key of the checkpoint's index."""

    from tests.models.kimi_k3.kimi_k3_checkpoint import (
        checkpoint_tensors,
        split_into_shards,
    )

    name = expert_tensor_name(1, 2, projection, suffix)
    tensors = checkpoint_tensors(SPEC)
    rows, cols = tensors[name].shape
    tensors[name] = tensors[name][:, : cols // 2].contiguous()  # half the width
    write_checkpoint(tmp_path, SPEC, split_into_shards(tensors, SPEC.shards))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert name in index["weight_map"]

    with pytest.raises(ValueError) as raised:
        load_rank(
            Topology(32),
            tmp_path,
            rank_config,
            moe_layers_only_model,
            kimi_model.KimiMoE,
        )
    message = str(raised.value)
    assert message.startswith(f"Kimi-K3 checkpoint tensor {name} (expert 2,")
    assert f"has shape {(rows, cols // 2)}, expected {(rows, cols)}" in message
