"""Strict Kimi-K3 expert loading in every published format: a mis-shaped,
duplicated or missing routed-expert tensor is refused by name."""

from __future__ import annotations

import pytest
import torch

from vllm_kimi_k3_moe.model_executor.layers.fused_moe import (
    strict_expert_loading as strict_loading,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

F8 = torch.float8_e4m3fn
# Checkpoint tensors of one expert at hidden 256 and intermediate 3072, per
# format: (suffix, w1/w3 shape, w2 shape, dtype). Projections w1/w3 are
# [3072, 256] and w2 [256, 3072] before packing or grouping; per-tensor
# values (global scales, a stored shape) last.
FORMATS = {
    "fp8-block": (
        "triton",  # float8 weights, one scale per 128 x 128 block
        [("weight", (3072, 256), (256, 3072), F8),
         ("weight_scale", (24, 2), (2, 24), torch.float32)],
    ),
    "nvfp4": (
        "flashinfer_cutedsl",  # FP4 two per byte, float8 scale per 16
        [("weight_packed", (3072, 128), (256, 1536), torch.uint8),
         ("weight_scale", (3072, 16), (256, 192), F8),
         ("weight_global_scale", (1,), (1,), torch.float32),
         ("input_global_scale", (1,), (1,), torch.float32)],
    ),
    "modelopt-nvfp4": (
        "flashinfer_cutedsl",  # the same, under ModelOpt's names
        [("weight", (3072, 128), (256, 1536), torch.uint8),
         ("weight_scale", (3072, 16), (256, 192), F8),
         ("weight_scale_2", (), (), torch.float32),
         ("input_scale", (), (), torch.float32)],
    ),
    "w4a16": (
        "marlin",  # eight int4 per int32, one scale per 32
        [("weight_packed", (3072, 32), (256, 384), torch.int32),
         ("weight_scale", (3072, 8), (256, 96), torch.bfloat16),
         ("weight_shape", (2,), (2,), torch.int64)],
    ),
    "bf16": ("triton", [("weight", (3072, 256), (256, 3072), torch.bfloat16)]),
    "ct-mxfp4": (
        "marlin",  # FP4 two per byte, one scale byte per 32
        [("weight_packed", (3072, 128), (256, 1536), torch.uint8),
         ("weight_scale", (3072, 8), (256, 96), torch.uint8)],
    ),
}  # fmt: skip
EXPERTS = 4
LAYER = "model.layers.1.block_sparse_moe.experts"


def checkpoint(fmt: str) -> dict[tuple[int, str, str], torch.Tensor]:
    """(expert, projection, suffix) -> a tensor of the right shape and dtype."""
    tensors = {}
    for expert in range(EXPERTS):
        for suffix, gate_up, down, dtype in FORMATS[fmt][1]:
            for projection in ("w1", "w3", "w2"):
                shape = down if projection == "w2" else gate_up
                tensors[(expert, projection, suffix)] = torch.ones(shape).to(dtype)
    return tensors


def load(experts, tensors) -> None:
    """Through each parameter's own ``weight_loader``, as ``load_weights``."""
    for (expert, projection, suffix), tensor in tensors.items():
        name = f"{'w2' if projection == 'w2' else 'w13'}_{suffix}"
        param = experts.get_parameter(name)
        param.weight_loader(
            param, tensor, f"{LAYER}.{name}", shard_id=projection, expert_id=expert
        )


@pytest.fixture
def experts(format_experts, request):
    fmt = request.param
    return fmt, format_experts(
        fmt, FORMATS[fmt][0], Topology(32), small=True, device="cpu"
    )


@pytest.mark.parametrize("experts", list(FORMATS), indirect=True)
def test_complete_checkpoint_loads(experts):
    fmt, layer = experts
    load(layer, checkpoint(fmt))
    ledger = strict_loading.expert_loading(layer)
    assert ledger is not None, f"{fmt}: no strict loading"
    assert ledger.missing() == []
    ledger.check_complete()


@pytest.mark.parametrize("experts", list(FORMATS), indirect=True)
def test_mis_shaped_tensor_is_refused_by_name(experts):
    fmt, layer = experts
    suffix, gate_up, _, dtype = FORMATS[fmt][1][0]
    bad = torch.ones(gate_up[0] // 2, gate_up[1]).to(dtype)  # intermediate 1536
    with pytest.raises(ValueError) as raised:
        load(layer, {(2, "w3", suffix): bad})
    message = str(raised.value)
    assert f"Kimi-K3 checkpoint tensor {LAYER}.2.w3.{suffix} (expert 2," in message
    assert f"has shape {(gate_up[0] // 2, gate_up[1])}, expected {gate_up}" in message


@pytest.mark.parametrize("experts", list(FORMATS), indirect=True)
def test_duplicate_and_missing_tensors_are_refused_by_name(experts):
    fmt, layer = experts
    tensors = checkpoint(fmt)
    suffix = FORMATS[fmt][1][-1][0]
    missing = tensors.pop((3, "w2", suffix))
    load(layer, tensors)
    with pytest.raises(ValueError, match=f"{LAYER}.1.w1.{suffix} .* second time"):
        load(layer, {(1, "w1", suffix): tensors[(1, "w1", suffix)]})
    with pytest.raises(ValueError, match=rf"never loaded: expert 3 \(w2.{suffix}\)"):
        strict_loading.expert_loading(layer).check_complete()
    load(layer, {(3, "w2", suffix): missing})
    strict_loading.expert_loading(layer).check_complete()
