"""vLLM's generic routed-expert loader fills only the valid region of each padded
TP partition, and the 32 TP ranks' 128-wide partitions together hold every
checkpoint element once."""

from __future__ import annotations

import pytest
import torch

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import routed_experts
from tests.models.kimi_k3.marks import on_both_quantization_paths
from tests.models.kimi_k3.mxfp4_checkpoint import (
    UNWRITTEN,
    checkpoint_indices,
    digit_planes,
    expert_parameters,
    load_and_decode,
    load_checkpoint,
)
from tests.models.kimi_k3.traced_checkpoint import assert_every_element_once
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

TP_SIZE = 32
RAW_LOCAL = 96  # 3072 // 32
PADDED_LOCAL = 128  # Marlin: next multiple of 128
HIDDEN = k3.SMALL_ROUTED_EXPERT_HIDDEN_SIZE  # 256: Marlin adds no hidden padding
EXPERTS = k3.SMALL_NUM_EXPERTS


@pytest.fixture(scope="module")
def indices():
    return checkpoint_indices(EXPERTS, HIDDEN, k3.MOE_INTERMEDIATE_SIZE)


@pytest.fixture(scope="module")
def planes(indices):
    """The checkpoint's digit planes, made once: every rank loads the same."""
    return digit_planes(indices)


def build_small(build_kimi_moe, topology, **kwargs):
    return routed_experts(build_kimi_moe(topology, small=True, device="cpu", **kwargs))


@on_both_quantization_paths
@pytest.mark.parametrize(
    ("rank", "rows", "w2_cols", "w2_scale_cols"),
    [
        # checkpoint intermediate rows [96r, 96r + 96); w2 packs that dimension
        # two per byte (48 bytes per rank) and scales it one byte per 32 (3).
        (0, (0, 96), (0, 48), (0, 3)),
        (31, (2976, 3072), (1488, 1536), (93, 96)),
    ],
)
def test_tp32_rank_placement(
    build_kimi_moe, indices, planes, quantization, rank, rows, w2_cols, w2_scale_cols
):
    decoded = load_and_decode(
        lambda: build_small(
            build_kimi_moe,
            Rank(Topology(TP_SIZE), tp_rank=rank),
            quantization=quantization,
        ),
        planes,
    )
    assert decoded["w13_weight"].shape == (EXPERTS, 2 * PADDED_LOCAL, HIDDEN // 2)

    expected = {n: torch.full_like(t, UNWRITTEN) for n, t in decoded.items()}
    r0, r1 = rows
    for e in range(EXPERTS):
        for suffix in ("weight", "weight_scale"):
            w13 = expected[f"w13_{suffix}"][e]
            w13[0:96] = indices[(e, "w1", suffix)][r0:r1]  # gate: first half
            w13[128:224] = indices[(e, "w3", suffix)][r0:r1]  # up: padded half
        c0, c1 = w2_cols
        expected["w2_weight"][e][:, 0:48] = indices[(e, "w2", "weight")][:, c0:c1]
        s0, s1 = w2_scale_cols
        expected["w2_weight_scale"][e][:, 0:3] = indices[(e, "w2", "weight_scale")][
            :, s0:s1
        ]
    for name in decoded:
        assert torch.equal(decoded[name], expected[name]), name


@on_both_quantization_paths
def test_every_checkpoint_element_lands_exactly_once_across_tp32(
    build_kimi_moe, indices, planes, quantization
):
    total = sum(t.numel() for t in indices.values())
    landed = []
    for rank in range(TP_SIZE):
        decoded = load_and_decode(
            lambda rank=rank: build_small(
                build_kimi_moe,
                Rank(Topology(TP_SIZE), tp_rank=rank),
                quantization=quantization,
            ),
            planes,
        )
        assert decoded["w2_weight"].shape[2] == PADDED_LOCAL // 2
        for values in decoded.values():
            landed.append(values[values != UNWRITTEN])
    assert_every_element_once(landed, total)


@on_both_quantization_paths
@pytest.mark.parametrize("rank", [0, 15, 31])
def test_padded_tail_stays_zero_after_loading(
    build_kimi_moe, planes, quantization, rank
):
    experts = build_small(
        build_kimi_moe, Rank(Topology(TP_SIZE), tp_rank=rank), quantization=quantization
    )
    load_checkpoint(experts, planes[0])
    params = expert_parameters(experts)
    assert params["w13_weight"].shape[1] == 2 * PADDED_LOCAL
    assert params["w2_weight"].shape[2] == PADDED_LOCAL // 2

    for suffix in ("weight", "weight_scale"):
        w13 = params[f"w13_{suffix}"]
        assert bool((w13[:, 0:96] != 0).all()) and bool((w13[:, 128:224] != 0).all())
        assert not w13[:, 96:128].any() and not w13[:, 224:256].any()
    assert bool((params["w2_weight"][..., 0:48] != 0).all())
    assert not params["w2_weight"][..., 48:64].any()
    assert bool((params["w2_weight_scale"][..., 0:3] != 0).all())
    assert not params["w2_weight_scale"][..., 3:4].any()


def loaded_state(experts, planes) -> dict[str, torch.Tensor]:
    load_checkpoint(experts, planes[0])
    return {n: p.clone() for n, p in expert_parameters(experts).items()}


def assert_identical_after_loading(patched, upstream, planes):
    """Same parameter names, shapes and loaded bytes; returns the loaded state."""
    assert [n for n, _ in patched.named_parameters()] == [
        n for n, _ in upstream.named_parameters()
    ]
    mine, theirs = loaded_state(patched, planes), loaded_state(upstream, planes)
    assert {n: t.shape for n, t in mine.items()} == {
        n: t.shape for n, t in theirs.items()
    }
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    return mine


@pytest.mark.parametrize("rank", [0, 7])
def test_tp8_is_byte_identical_to_upstream(build_kimi_moe, planes, rank):
    """At TP8 nobody pads (3072 // 8 == 384): the plugin must change nothing."""
    patched = build_small(build_kimi_moe, Rank(Topology(8), tp_rank=rank))
    upstream = build_small(
        build_kimi_moe, Rank(Topology(8), tp_rank=rank), upstream=True
    )
    loaded = assert_identical_after_loading(patched, upstream, planes)
    assert loaded["w13_weight"].shape[1] == 2 * 384


def test_tp32_differs_from_upstream_only_in_partition_width(build_kimi_moe, planes):
    """Same names and valid bytes; upstream allocates 256 per rank, we 128."""
    patched = build_small(build_kimi_moe, Rank(Topology(TP_SIZE), tp_rank=5))
    upstream = build_small(
        build_kimi_moe, Rank(Topology(TP_SIZE), tp_rank=5), upstream=True
    )
    mine, theirs = loaded_state(patched, planes), loaded_state(upstream, planes)
    assert list(mine) == list(theirs)
    assert mine["w13_weight"].shape[1] == 2 * 128
    assert theirs["w13_weight"].shape[1] == 2 * 256
    for suffix in ("weight", "weight_scale"):
        name = f"w13_{suffix}"
        assert torch.equal(mine[name][:, 0:96], theirs[name][:, 0:96])
        assert torch.equal(mine[name][:, 128:224], theirs[name][:, 256:352])
    assert torch.equal(mine["w2_weight"][..., 0:48], theirs["w2_weight"][..., 0:48])
    assert torch.equal(
        mine["w2_weight_scale"][..., 0:3], theirs["w2_weight_scale"][..., 0:3]
    )


@pytest.mark.parametrize("rank", [0, 3])
def test_expert_parallel_is_byte_identical_to_upstream(build_kimi_moe, planes, rank):
    """EP (4 ranks, one expert each): no padding anywhere, as upstream."""
    topology = Rank(Topology(4, expert_parallel=True), tp_rank=rank)
    patched = build_small(build_kimi_moe, topology)
    upstream = build_small(build_kimi_moe, topology, upstream=True)
    assert patched.moe_config.moe_parallel_config.use_ep
    assert patched.local_num_experts == 1
    loaded = assert_identical_after_loading(patched, upstream, planes)
    assert loaded["w13_weight"].shape[1] == 2 * 3072


def test_expert_parallel_tp32_real_size_matches_upstream(build_kimi_moe):
    topology = Rank(Topology(TP_SIZE, expert_parallel=True), tp_rank=31)
    patched = build_kimi_moe(topology)
    upstream = build_kimi_moe(topology, upstream=True)
    assert patched.padded_moe_intermediate_size == 3072
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in patched.named_parameters()}
    assert shapes == {
        n: (tuple(p.shape), p.dtype) for n, p in upstream.named_parameters()
    }
    assert shapes["experts.routed_experts.w13_weight"][0] == (28, 2 * 3072, 1792)
