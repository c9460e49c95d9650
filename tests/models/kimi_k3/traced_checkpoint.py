"""Routed-expert checkpoint tensors, in any format's dtypes, whose values trace
back to the checkpoint element they came from.

Every element of every TP-sharded expert tensor gets a distinct index. One
load carries one base-15 digit of it, stored as digit + 2: 2..16 are exact in
every dtype a format uses (uint8, float8_e4m3fn, bfloat16, float32), 0 is
"never written" and 1 is the unit scale vLLM's block-aligned loader writes
into the pad. Loading the digit planes into fresh layers and decoding tells,
per parameter element, which checkpoint element landed there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

BASE = 15
OFFSET = 2  # digit d is stored as d + 2
UNWRITTEN = -1
PROJECTIONS = ("w1", "w3", "w2")


@dataclass(frozen=True)
class ExpertTensor:
    """One TP-sharded checkpoint tensor of every expert."""

    projection: str  # w1 (gate), w3 (up), w2 (down)
    suffix: str  # as in the checkpoint: weight, weight_packed, weight_scale
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def parameter(self) -> str:
        """The ``RoutedExperts`` parameter vLLM loads it into."""
        return f"{'w2' if self.projection == 'w2' else 'w13'}_{self.suffix}"


def _expert_tensors(
    hidden: int, intermediate: int, stored: list[tuple[str, int, int, torch.dtype]]
) -> list[ExpertTensor]:
    """Per projection, each ``(suffix, output values per element, input
    values per element, dtype)``: w1/w3 are [intermediate, hidden], w2
    [hidden, intermediate] before packing, grouping or blocking."""
    out = []
    for projection in PROJECTIONS:
        rows, cols = (
            (hidden, intermediate) if projection == "w2" else (intermediate, hidden)
        )
        for suffix, per_row, per_col, dtype in stored:
            shape = (rows // per_row, cols // per_col)
            out.append(ExpertTensor(projection, suffix, shape, dtype))
    return out


def fp8_block_tensors(hidden: int, intermediate: int) -> list[ExpertTensor]:
    """compressed-tensors FP8 block [128, 128]: float8 weights, one float32
    scale per 128 x 128 block."""
    return _expert_tensors(
        hidden,
        intermediate,
        [
            ("weight", 1, 1, torch.float8_e4m3fn),
            ("weight_scale", 128, 128, torch.float32),
        ],
    )


def nvfp4_tensors(hidden: int, intermediate: int) -> list[ExpertTensor]:
    """compressed-tensors NVFP4: FP4 packed two per byte, one float8 scale per
    16 values (per-expert global scales are not TP-sharded: not traced)."""
    return _expert_tensors(
        hidden,
        intermediate,
        [
            ("weight_packed", 1, 2, torch.uint8),
            ("weight_scale", 1, 16, torch.float8_e4m3fn),
        ],
    )


def assert_every_element_once(landed: list[torch.Tensor], total: int) -> None:
    """``landed``: the checkpoint indices every rank holds. Each of the
    ``total`` checkpoint elements must be held exactly once."""
    counts = torch.bincount(torch.cat(landed), minlength=total)
    assert counts.numel() == total, "decoded an index beyond the checkpoint"
    assert int((counts == 0).sum()) == 0, "checkpoint elements never loaded"
    assert int((counts > 1).sum()) == 0, "checkpoint elements loaded twice"


Key = tuple[int, ExpertTensor]  # (expert id, tensor)


def checkpoint_indices(
    num_experts: int, tensors: list[ExpertTensor]
) -> dict[Key, torch.Tensor]:
    """Distinct int64 indices, one per checkpoint element, 0..total-1."""
    indices: dict[Key, torch.Tensor] = {}
    start = 0
    for expert in range(num_experts):
        for tensor in tensors:
            count = math.prod(tensor.shape)
            indices[(expert, tensor)] = torch.arange(start, start + count).reshape(
                tensor.shape
            )
            start += count
    return indices


Plane = dict[Key, torch.Tensor]  # one digit of every index, in the tensor's dtype


def digit_planes(indices: dict[Key, torch.Tensor]) -> list[Plane]:
    """The checkpoint, once per base-15 digit of its indices."""
    total = sum(index.numel() for index in indices.values())
    return [
        {
            key: ((index // BASE**digit) % BASE + OFFSET)
            .to(torch.float32)
            .to(key[1].dtype)
            for key, index in indices.items()
        }
        for digit in range(max(1, math.ceil(math.log(total, BASE))))
    ]


def load_plane(experts: nn.Module, plane: Plane) -> None:
    """Feed one digit plane through each parameter's own ``weight_loader``,
    as ``RoutedExperts.load_weights`` does."""
    for (expert, tensor), values in plane.items():
        param = experts.get_parameter(tensor.parameter)
        param.weight_loader(
            param,
            values,
            f"{experts.layer_name}.{tensor.parameter}",
            shard_id=tensor.projection,
            expert_id=expert,
        )


def load_and_decode(
    make_experts: Callable[[], nn.Module], planes: list[Plane]
) -> dict[str, torch.Tensor]:
    """Load each plane into a fresh layer; per traced parameter element: the
    checkpoint index it received, or UNWRITTEN (zero, or the pad's unit
    scale)."""
    names = {tensor.parameter for _, tensor in planes[0]}
    decoded: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    for digit, plane in enumerate(planes):
        experts = make_experts()
        load_plane(experts, plane)
        for name in names:
            value = experts.get_parameter(name).data.to(torch.float32).round().long()
            if digit == 0:
                decoded[name] = torch.zeros_like(value)
                written[name] = value >= OFFSET
            decoded[name] += (value - OFFSET).clamp(min=0) * BASE**digit
    for name in names:
        decoded[name][~written[name]] = UNWRITTEN
    return decoded
