"""FP8-block and NVFP4 Kimi-K3 experts load through vLLM's real weight loader
into the plugin's partitions: each TP32 rank holds exactly its rows, the pad
receives nothing, and the 32 ranks together hold every checkpoint element
once."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.traced_checkpoint import (
    UNWRITTEN,
    assert_every_element_once,
    checkpoint_indices,
    digit_planes,
    fp8_block_tensors,
    load_and_decode,
    nvfp4_tensors,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

TP_SIZE = 32
INTERMEDIATE = k3.MOE_INTERMEDIATE_SIZE  # 3072
HIDDEN = k3.SMALL_ROUTED_EXPERT_HIDDEN_SIZE  # 256
EXPERTS = k3.SMALL_NUM_EXPERTS

# (format, --moe-backend, checkpoint tensors, partition per rank, checkpoint
# intermediate rows [start, end) that ranks 0, 23 and 31 hold)
CASES = [
    # whole 128-row blocks per rank (block scales stay rank-local): ranks
    # 0-23 hold 128 rows each, ranks 24-31 none
    ("fp8-block", "triton", fp8_block_tensors, 128, [(0, 128), (2944, 3072), None]),
    # 96 rows per rank in a 128-row partition: what FlashInfer's kernels
    # keep once their weight preparation padded gate and up to 64s
    (
        "nvfp4",
        "flashinfer_cutedsl",
        nvfp4_tensors,
        128,
        [(0, 96), (2208, 2304), (2976, 3072)],
    ),
    # ... and what CUTLASS's weight preparation takes (2N % 128)
    ("nvfp4", "cutlass", nvfp4_tensors, 128, [(0, 96), (2208, 2304), (2976, 3072)]),
]
IDS = ["fp8-block-triton", "nvfp4-flashinfer", "nvfp4-cutlass"]
PLACED = (0, 23, 31)  # the ranks whose placement is checked row by row


@functools.cache
def traced(tensors: Callable[[int, int], list]) -> tuple[dict, list]:
    """The checkpoint's indices and digit planes, made once per set of
    tensors (both NVFP4 backends load the same): every rank loads the same."""
    indices = checkpoint_indices(EXPERTS, tensors(HIDDEN, INTERMEDIATE))
    return indices, digit_planes(indices)


# What ranks PLACED decoded, by (format, backend, rank): each is loaded once,
# by whichever of the two tests below gets to it first.
_DECODED: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}


def decoded_rank(format_experts, fmt, backend, tensors, partition, rank):
    """TP32 rank ``rank``'s layer, built with ``partition`` rows, loaded with
    every digit plane and decoded (``load_and_decode``)."""
    key = (fmt, backend, rank)
    if key in _DECODED:
        return _DECODED[key]

    def make():
        experts = format_experts(
            fmt,
            backend,
            Rank(Topology(TP_SIZE), tp_rank=rank),
            small=True,
            device="cpu",
        )
        assert experts.intermediate_size_per_partition == partition
        return experts

    decoded = load_and_decode(make, traced(tensors)[1])
    if rank in PLACED:
        _DECODED[key] = decoded
    return decoded


def expected_placement(decoded, indices, partition, rows):
    """What each traced parameter must hold when a rank owns checkpoint
    intermediate ``rows`` (None: nothing) in a ``partition``-row partition."""
    expected = {name: torch.full_like(t, UNWRITTEN) for name, t in decoded.items()}
    if rows is None:
        return expected
    start, end = rows
    for (expert, tensor), index in indices.items():
        target = expected[tensor.parameter][expert]
        if tensor.projection == "w2":  # intermediate is the input (column) dim
            unit = INTERMEDIATE // tensor.shape[1]
            count = (end - start) // unit
            target[:, :count] = index[:, start // unit : end // unit]
        else:  # intermediate is the output (row) dim; w3 fills the second half
            unit = INTERMEDIATE // tensor.shape[0]
            count = (end - start) // unit
            first = 0 if tensor.projection == "w1" else partition // unit
            target[first : first + count] = index[start // unit : end // unit]
    return expected


@pytest.mark.parametrize(
    ("fmt", "backend", "tensors", "partition", "held"), CASES, ids=IDS
)
@pytest.mark.parametrize("rank_index", [0, 1, 2])
def test_tp32_rank_holds_exactly_its_rows(
    format_experts, fmt, backend, tensors, partition, held, rank_index
):
    rank = PLACED[rank_index]
    indices = traced(tensors)[0]
    decoded = decoded_rank(format_experts, fmt, backend, tensors, partition, rank)
    expected = expected_placement(decoded, indices, partition, held[rank_index])
    for name in decoded:
        assert torch.equal(decoded[name], expected[name]), name


@pytest.mark.parametrize(
    ("fmt", "backend", "tensors", "partition", "held"), CASES, ids=IDS
)
def test_every_checkpoint_element_lands_exactly_once_across_tp32(
    format_experts, fmt, backend, tensors, partition, held
):
    indices = traced(tensors)[0]
    total = sum(index.numel() for index in indices.values())
    landed = []
    for rank in range(TP_SIZE):
        decoded = decoded_rank(format_experts, fmt, backend, tensors, partition, rank)
        for values in decoded.values():
            landed.append(values[values != UNWRITTEN])
    assert_every_element_once(landed, total)
