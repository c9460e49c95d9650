"""A small checkpoint in each published Kimi-K3 format, loaded as vLLM loads it
(``ModelConfig`` reads its ``config.json``, ``DefaultModelLoader`` streams the
shards, Kimi-K3's name mapping reaches each rank's loader) into every rank of
TP8, TP16, TP32 and an expert-parallel deployment: the ranks' valid regions
give back every routed-expert tensor bit for bit. Which rows each rank holds
is what the format's record says (``CheckpointFormat.rank_rows``, which
``check`` prints): were it not what vLLM loads, the pieces would not fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models.kimi_k3.builders import routed_experts
from tests.models.kimi_k3.format_checkpoints import (
    FORMAT_TENSORS,
    write_format_checkpoint_with_data,
)
from tests.models.kimi_k3.kimi_k3_checkpoint import KimiK3Spec, expert_tensor_name
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.formats import recognise
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank, simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import moe_kernels_on_their_gpu
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config

# One MoE layer (1) of four experts; the real 3072 intermediate size.
SPEC = KimiK3Spec(num_experts=4, num_hidden_layers=2, num_nextn_predict_layers=0)
LAYER = 1
INTERMEDIATE = SPEC.moe_intermediate_size
ROUTED_EXPERTS = ".block_sparse_moe.experts."


@pytest.fixture(scope="module", params=list(FORMAT_TENSORS))
def checkpoint(request, tmp_path_factory):
    fmt = request.param
    directory = tmp_path_factory.mktemp(f"kimi-k3-{fmt}")
    return fmt, directory, write_format_checkpoint_with_data(directory, fmt, SPEC)


def load_rank(moe_layers_only_model, kimi_model, directory, rank: Rank) -> nn.Module:
    """Build ``rank`` from the checkpoint's config and load the checkpoint
    into it, as vLLM's default loader does (Marlin where the format has it,
    Triton for BF16)."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    with simulated_rank(rank), moe_kernels_on_their_gpu():
        vllm_config = rank_vllm_config(directory, rank.topology, "marlin")
        model = moe_layers_only_model(vllm_config, kimi_model.KimiMoE)
        weights = DefaultModelLoader(LoadConfig()).get_all_weights(
            vllm_config.model_config, model
        )
        AutoWeightsLoader(model).load_weights(
            ((name, w) for name, w in weights if ROUTED_EXPERTS in name),
            mapper=KimiK3ForConditionalGeneration.hf_to_vllm_mapper,
        )
    layers = model.language_model.model.layers
    return routed_experts(layers[LAYER].block_sparse_moe)


def parameter(experts: nn.Module, projection: str, suffix: str) -> torch.Tensor:
    return getattr(experts, f"{'w2' if projection == 'w2' else 'w13'}_{suffix}")


def recognised(fmt: str):
    return recognise(QUANTIZATION_CONFIGS[fmt], None, "config.json")


def rows_held(fmt: str, rank: int, tp_size: int) -> tuple[int, int]:
    """Checkpoint intermediate rows [start, end) TP rank ``rank`` holds, as
    the format's record (vLLM-free) says: an even slice, or whole groups of
    its partition (block-aligned loading: FP8 blocks and INT groups of 128
    at TP32 ranks 0-23 128 rows each, 24-31 none)."""
    return recognised(fmt).rank_rows(INTERMEDIATE, tp_size)[rank]


def intermediate_dim(fmt: str, projection: str, suffix: str) -> int:
    """The dimension of a checkpoint tensor (and of vLLM's parameter for one
    expert, which keeps the checkpoint's orientation) that runs along the
    intermediate rows: w1/w3's output, w2's input; swapped for the
    input-first layouts (AutoAWQ, AutoGPTQ)."""
    layout = next(t for t in recognised(fmt).tensors.sharded if t.suffix == suffix)
    return int(projection == "w2") ^ int(layout.transposed)


def valid_region(
    fmt, experts, projection, suffix, checkpoint_tensor, rows, local_expert
):
    """The part of a rank's parameter that holds the checkpoint's ``rows``."""
    param = parameter(experts, projection, suffix)[local_expert]
    start, end = rows
    dim = intermediate_dim(fmt, projection, suffix)
    held = (end - start) // (INTERMEDIATE // checkpoint_tensor.shape[dim])
    first = param.shape[dim] // 2 if projection == "w3" else 0
    return param.narrow(dim, first, held)


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal shapes and bytes (in the checkpoint's dtype)."""
    if actual.shape != expected.shape:
        return False
    actual = actual.to(expected.dtype).contiguous().reshape(-1)
    expected = expected.contiguous().reshape(-1)
    return torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def suffixes(fmt: str, *, sharded: bool) -> list[str]:
    """The format's TP-sharded (matrix) or per-tensor (scale, shape) suffixes."""
    return [
        suffix
        for suffix, shape, _ in FORMAT_TENSORS[fmt]
        if (len(shape(8, 8)) == 2) == sharded
    ]


def per_tensor_value(experts, projection, suffix, local_expert) -> torch.Tensor:
    """What a rank holds of a per-tensor checkpoint value: w1 and w3 side by
    side in ``w13_*``; a stored shape (the same for w1 and w3) whole."""
    param = parameter(experts, projection, suffix)[local_expert]
    if suffix == "weight_shape" or projection == "w2":
        return param
    return param[0 if projection == "w1" else 1]


def assert_per_tensor_values(fmt, tensors, experts_of) -> None:
    for expert in range(SPEC.num_experts):
        experts, local = experts_of(expert)
        for projection in ("w1", "w3", "w2"):
            for suffix in suffixes(fmt, sharded=False):
                name = expert_tensor_name(LAYER, expert, projection, suffix)
                expected = tensors[name]
                value = per_tensor_value(experts, projection, suffix, local)
                assert same_bits(value.reshape(expected.shape), expected), name


# Without expert parallelism vLLM shards every expert over TP x DP GPUs (GPU
# r of that group: TP rank r % TP of DP rank r // TP), as check says; at
# TP16 x DP2 (vLLM alone pads to 128 there) and TP8 x DP4 (it pads nothing:
# the formats whose groups 96 rows split) FP8 blocks and INT groups of 128
# are loaded whole over all 32 (ranks 0-23 one each).
TOPOLOGIES = [
    Topology(8),
    Topology(16),
    Topology(32),
    Topology(16, dp_size=2),
    Topology(8, dp_size=4),
]
WHOLE_GROUPS_OF_96 = ("fp8-block", "awq", "gptq")


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: t.label())
def test_tp_ranks_give_back_every_expert_tensor(
    checkpoint, topology, moe_layers_only_model, kimi_model
):
    fmt, directory, tensors = checkpoint
    if topology.dp_size == 4 and fmt not in WHOLE_GROUPS_OF_96:
        pytest.skip("an even split like TP16 x DP2's, without model-level padding")
    tp_size = topology.moe_group
    ranks = [
        load_rank(
            moe_layers_only_model,
            kimi_model,
            directory,
            Rank(
                topology,
                tp_rank=r % topology.tp_size,
                dp_rank=r // topology.tp_size,
            ),
        )
        for r in range(tp_size)
    ]
    for expert in range(SPEC.num_experts):
        for projection in ("w1", "w3", "w2"):
            for suffix in suffixes(fmt, sharded=True):
                name = expert_tensor_name(LAYER, expert, projection, suffix)
                expected = tensors[name]
                pieces = [
                    valid_region(
                        fmt,
                        experts,
                        projection,
                        suffix,
                        expected,
                        rows_held(fmt, rank, tp_size),
                        expert,
                    )
                    for rank, experts in enumerate(ranks)
                ]
                dim = intermediate_dim(fmt, projection, suffix)
                whole = torch.cat(pieces, dim=dim)
                assert same_bits(whole, expected), f"{fmt}: {name}"
    for experts in ranks:  # every rank holds every expert's per-tensor values
        assert_per_tensor_values(fmt, tensors, lambda e, x=experts: (x, e))


def test_expert_parallel_ranks_give_back_every_expert_tensor(
    checkpoint, moe_layers_only_model, kimi_model
):
    fmt, directory, tensors = checkpoint
    ep_size = 4
    ranks = [
        load_rank(
            moe_layers_only_model,
            kimi_model,
            directory,
            Rank(Topology(ep_size, expert_parallel=True), tp_rank=r),
        )
        for r in range(ep_size)
    ]
    per_rank = SPEC.num_experts // ep_size
    for expert in range(SPEC.num_experts):
        experts = ranks[expert // per_rank]
        for projection in ("w1", "w3", "w2"):
            for suffix in suffixes(fmt, sharded=True):
                name = expert_tensor_name(LAYER, expert, projection, suffix)
                region = valid_region(
                    fmt,
                    experts,
                    projection,
                    suffix,
                    tensors[name],
                    (0, INTERMEDIATE),
                    expert % per_rank,
                )
                assert same_bits(region, tensors[name]), f"{fmt}: {name}"
    assert_per_tensor_values(
        fmt, tensors, lambda e: (ranks[e // per_rank], e % per_rank)
    )
