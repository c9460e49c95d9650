"""Kimi-K3 routed-expert loading refuses malformed, duplicated and missing expert
tensors with errors that name them, and loads valid tensors as before."""

from __future__ import annotations

import re

import pytest
import torch

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import (
    build_kimi_moe_layer,
    kimi_k3_text_config,
    routed_experts,
)
from tests.models.kimi_k3.marks import on_both_quantization_paths
from tests.models.kimi_k3.mxfp4_checkpoint import (
    checkpoint_indices,
    digit_plane,
    expert_parameters,
    load_checkpoint,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe import (
    strict_expert_loading as strict_loading,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

HIDDEN = k3.SMALL_ROUTED_EXPERT_HIDDEN_SIZE  # 256
EXPERTS = k3.SMALL_NUM_EXPERTS  # 4
LAYER = "model.layers.1.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def checkpoint() -> dict:
    """A complete small checkpoint: distinct non-zero bytes per tensor."""
    indices = checkpoint_indices(EXPERTS, HIDDEN, k3.MOE_INTERMEDIATE_SIZE)
    return {key: digit_plane(value, 0) for key, value in indices.items()}


TP32_RANK0 = Rank(Topology(32), tp_rank=0)


def build(build_kimi_moe, quantization="mxfp4", topology=TP32_RANK0):
    return routed_experts(
        build_kimi_moe(topology, small=True, device="cpu", quantization=quantization)
    )


def ledger(experts):
    return strict_loading.expert_loading(experts)


def checkpoint_name(expert: int, projection: str, suffix: str) -> str:
    """The key errors name: the checkpoint's, whose packed MXFP4 weights are
    ``weight_packed`` on both paths (native MXFP4 loads them into
    ``w13_weight``). Fed to the loader directly, keys start at the layer."""
    suffix = "weight_packed" if suffix == "weight" else suffix
    return f"{LAYER}.{expert}.{projection}.{suffix}"


def snapshot(experts) -> dict[str, torch.Tensor]:
    return {n: p.clone() for n, p in expert_parameters(experts).items()}


def assert_unchanged(experts, before: dict[str, torch.Tensor]) -> None:
    for name, tensor in expert_parameters(experts).items():
        assert torch.equal(tensor, before[name]), f"{name} was written"


# Logical (checkpoint) shapes with HIDDEN 256 and I 3072: w1/w3 weight
# (3072, 128), w1/w3 scale (3072, 8), w2 weight (256, 1536), w2 scale (256, 96).
MALFORMED = [
    # (case, projection, suffix, expected shape, malformed shape)
    ("intermediate 2048", "w1", "weight", (3072, 128), (2048, 128)),
    ("intermediate 3000", "w3", "weight", (3072, 128), (3000, 128)),
    ("intermediate 4096", "w2", "weight", (256, 1536), (256, 2048)),
    ("hidden 512", "w2", "weight", (256, 1536), (512, 1536)),
    ("hidden 128 in w1", "w1", "weight", (3072, 128), (3072, 64)),
    ("packed width unpacked", "w1", "weight", (3072, 128), (3072, 256)),
    ("scale width 64 per byte", "w2", "weight_scale", (256, 96), (256, 48)),
    ("scale rows", "w3", "weight_scale", (3072, 8), (1536, 8)),
    ("transposed w1", "w1", "weight", (3072, 128), (128, 3072)),
    ("transposed w2 scale", "w2", "weight_scale", (256, 96), (96, 256)),
    ("stacked experts", "w1", "weight", (3072, 128), (EXPERTS, 3072, 128)),
]


@on_both_quantization_paths
@pytest.mark.parametrize(
    ("projection", "suffix", "expected", "malformed"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_tensor_is_refused_before_any_copy(
    build_kimi_moe, checkpoint, quantization, projection, suffix, expected, malformed
):
    experts = build(build_kimi_moe, quantization)
    load_checkpoint(experts, {k: v for k, v in checkpoint.items() if k[0] != 2})
    before = snapshot(experts)
    bad = torch.full(malformed, 7, dtype=torch.uint8)

    with pytest.raises(ValueError) as raised:
        load_checkpoint(experts, {(2, projection, suffix): bad})

    message = str(raised.value)
    assert checkpoint_name(2, projection, suffix) in message
    assert "expert 2" in message
    assert str(expected) in message
    assert str(tuple(malformed)) in message
    assert_unchanged(experts, before)


@on_both_quantization_paths
@pytest.mark.parametrize(
    ("projection", "suffix", "shape", "dtype", "stored"),
    [
        ("w1", "weight", (3072, 128), torch.bfloat16, "BF16"),  # cast into bytes
        ("w2", "weight_scale", (256, 96), torch.float8_e4m3fn, "F8_E4M3"),
        ("w3", "weight", (3072, 128), torch.int8, "I8"),
    ],
)
def test_wrong_dtype_is_refused_before_any_copy(
    build_kimi_moe, checkpoint, quantization, projection, suffix, shape, dtype, stored
):
    """Right shape, wrong dtype: upstream's copy_ would cast it value by value
    into the packed MXFP4 bytes."""
    experts = build(build_kimi_moe, quantization)
    load_checkpoint(experts, {k: v for k, v in checkpoint.items() if k[0] != 2})
    before = snapshot(experts)
    bad = torch.full(shape, 7).to(dtype)

    with pytest.raises(ValueError) as raised:
        load_checkpoint(experts, {(2, projection, suffix): bad})

    message = str(raised.value)
    assert message.startswith(
        f"Kimi-K3 checkpoint tensor {checkpoint_name(2, projection, suffix)} "
        "(expert 2, loaded into "
    )
    assert f"has dtype {stored} ({dtype}), expected U8 in MXFP4; " in message
    assert_unchanged(experts, before)


@on_both_quantization_paths
def test_duplicated_tensor_is_refused_before_any_copy(
    build_kimi_moe, checkpoint, quantization
):
    experts = build(build_kimi_moe, quantization)
    load_checkpoint(experts, checkpoint)
    before = snapshot(experts)
    again = torch.full((3072, 128), 9, dtype=torch.uint8)

    with pytest.raises(ValueError, match="second time") as raised:
        load_checkpoint(experts, {(1, "w3", "weight"): again})

    assert checkpoint_name(1, "w3", "weight") in str(raised.value)
    assert "expert 1" in str(raised.value)
    assert_unchanged(experts, before)


@on_both_quantization_paths
@pytest.mark.parametrize(
    ("omitted", "listed"),
    [
        # A whole expert: all six of its tensors.
        (
            [(1, s, k) for s in ("w1", "w3", "w2") for k in ("weight", "weight_scale")],
            {1: ["w1.weight", "w1.weight_scale", "w2.weight", "w2.weight_scale",
                 "w3.weight", "w3.weight_scale"]},
        ),
        ([(3, "w2", "weight_scale")], {3: ["w2.weight_scale"]}),
        ([(0, "w3", "weight"), (2, "w1", "weight_scale")],
         {0: ["w3.weight"], 2: ["w1.weight_scale"]}),
    ],
    ids=["missing expert", "missing scale", "missing across experts"],
)  # fmt: skip
def test_incomplete_checkpoint_is_reported_by_name(
    build_kimi_moe, checkpoint, quantization, omitted, listed
):
    experts = build(build_kimi_moe, quantization)
    load_checkpoint(experts, {k: v for k, v in checkpoint.items() if k not in omitted})

    with pytest.raises(ValueError, match="never loaded") as raised:
        ledger(experts).check_complete()

    message = str(raised.value)
    assert f"{len(omitted)} routed-expert checkpoint tensors" in message
    assert LAYER in message
    listed = {  # packed weights are "weight_packed" in the checkpoint
        e: [t.replace("weight", "weight_packed", 1) if "scale" not in t else t
            for t in ts]
        for e, ts in listed.items()
    }  # fmt: skip
    expected = "; ".join(
        f"expert {e} ({', '.join(sorted(ts))})" for e, ts in sorted(listed.items())
    )
    assert expected in message


def test_completeness_runs_before_weight_processing(build_kimi_moe, checkpoint):
    """vLLM calls ``quant_method.process_weights_after_loading`` once the
    checkpoint is read; an incomplete layer fails there, before any repacking."""
    experts = build(build_kimi_moe)
    load_checkpoint(experts, {k: v for k, v in checkpoint.items() if k[0] != 0})
    with pytest.raises(ValueError, match=re.escape("expert 0 (w1.weight_packed,")):
        experts.quant_method.process_weights_after_loading(experts)


@on_both_quantization_paths
def test_complete_checkpoint_passes(build_kimi_moe, checkpoint, quantization):
    experts = build(build_kimi_moe, quantization)
    load_checkpoint(experts, checkpoint)
    assert ledger(experts).missing() == []
    ledger(experts).check_complete()


def test_expert_parallel_rank_needs_only_its_experts(build_kimi_moe, checkpoint):
    """EP over 4 ranks: rank 1 holds expert 1 only. Tensors of other experts are
    still shape-checked but neither stored nor expected."""
    experts = build(
        build_kimi_moe, topology=Rank(Topology(4, expert_parallel=True), tp_rank=1)
    )
    load_checkpoint(experts, {k: v for k, v in checkpoint.items() if k[0] != 3})
    ledger(experts).check_complete()
    with pytest.raises(ValueError, match="expert 3"):
        load_checkpoint(experts, {(3, "w1", "weight"): torch.ones(3072, 64)})

    other_rank = build(
        build_kimi_moe, topology=Rank(Topology(4, expert_parallel=True), tp_rank=3)
    )
    load_checkpoint(other_rank, {k: v for k, v in checkpoint.items() if k[0] != 3})
    with pytest.raises(ValueError, match=re.escape("expert 3 (w1.weight_packed,")):
        ledger(other_rank).check_complete()


def test_layer_filled_without_the_loader_is_left_alone(
    kimi_model, rank_config, build_kimi_moe, checkpoint
):
    """Dummy weights, tensorizer and weight caches never call the loader: a
    layer with no expert tensor passes while no other layer of its model was
    loaded, and is reported as missing everything once one was. Another
    model's load does not count."""
    vllm_config = rank_config(TP32_RANK0)
    untouched, loaded = (
        routed_experts(
            build_kimi_moe_layer(
                kimi_model.KimiMoE,
                kimi_k3_text_config(small=True),
                vllm_config,
                device="cpu",
                prefix=f"model.layers.{layer}.block_sparse_moe",
            )
        )
        for layer in (1, 2)
    )
    other_model = build(build_kimi_moe)
    load_checkpoint(other_model, checkpoint)
    ledger(untouched).check_complete()

    load_checkpoint(loaded, checkpoint)
    with pytest.raises(ValueError, match="24 routed-expert checkpoint tensors"):
        ledger(untouched).check_complete()


def test_valid_tensor_reaches_upstream_loader_as_is(
    build_kimi_moe, checkpoint, monkeypatch
):
    """No copy on the way: upstream's loader receives the checkpoint tensor."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    received = []
    upstream_loader = RoutedExperts.weight_loader

    def spy(self, param, loaded_weight, *args, **kwargs):
        received.append(loaded_weight)
        return upstream_loader(self, param, loaded_weight, *args, **kwargs)

    # before the build: each parameter's loader is the layer's, bound there
    monkeypatch.setattr(RoutedExperts, "weight_loader", spy)
    experts = build(build_kimi_moe)
    load_checkpoint(experts, checkpoint)
    assert len(received) == len(checkpoint)
    assert all(a is b for a, b in zip(received, checkpoint.values(), strict=True))
