"""Kimi-K3 MXFP4 routed-expert checkpoint tensors with traceable, non-zero bytes.

Every element of every tensor gets a distinct index. A uint8 holds one base-255
digit of it (stored as digit + 1, so no checkpoint byte is ever zero): loading
the digit planes one after another and decoding what each parameter byte held
tells which checkpoint element landed there, and zero means "never written".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from tests.models.kimi_k3 import kimi_k3_shapes as k3

BASE = 255
DIGITS = 3  # 255**3 > 16M indices: more than the small checkpoints hold
PROJECTIONS = ("w1", "w3", "w2")
SUFFIXES = ("weight", "weight_scale")
TensorKey = tuple[int, str, str]  # (expert id, projection, suffix)


def logical_shape(projection: str, suffix: str, hidden: int, intermediate: int):
    """Checkpoint shape: w1/w3 are [intermediate, hidden], w2 [hidden,
    intermediate]; MXFP4 packs the input (last) dimension two values per byte
    and keeps one scale byte per 32 values of it."""
    per_byte = k3.MXFP4_VALUES_PER_BYTE if suffix == "weight" else k3.MXFP4_BLOCK
    if projection == "w2":
        return (hidden, intermediate // per_byte)
    return (intermediate, hidden // per_byte)


def checkpoint_keys(num_experts: int) -> Iterator[TensorKey]:
    for expert in range(num_experts):
        for projection in PROJECTIONS:
            for suffix in SUFFIXES:
                yield expert, projection, suffix


def checkpoint_indices(
    num_experts: int, hidden: int, intermediate: int
) -> dict[TensorKey, torch.Tensor]:
    """Distinct int64 indices, one per checkpoint element, 0..total-1."""
    indices: dict[TensorKey, torch.Tensor] = {}
    start = 0
    for key in checkpoint_keys(num_experts):
        shape = logical_shape(key[1], key[2], hidden, intermediate)
        count = shape[0] * shape[1]
        indices[key] = torch.arange(start, start + count).reshape(shape)
        start += count
    return indices


def digit_plane(indices: torch.Tensor, digit: int) -> torch.Tensor:
    """The uint8 checkpoint tensor for one base-255 digit (1..255, never 0)."""
    return ((indices // BASE**digit) % BASE + 1).to(torch.uint8)


Plane = dict[TensorKey, torch.Tensor]  # one digit of every index, as uint8


def digit_planes(indices: dict[TensorKey, torch.Tensor]) -> list[Plane]:
    """The checkpoint, once per base-255 digit of its indices: made once and
    loaded into every rank (the same tensors for each)."""
    return [
        {key: digit_plane(index, digit) for key, index in indices.items()}
        for digit in range(DIGITS)
    ]


EXPERT_PARAMETERS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
UNWRITTEN = -1


def expert_parameter_name(experts: nn.Module, projection: str, suffix: str) -> str:
    """The parameter a checkpoint tensor loads into; compressed-tensors MXFP4
    names the packed weights ``*_weight_packed``, native MXFP4 ``*_weight``."""
    name = f"{'w2' if projection == 'w2' else 'w13'}_{suffix}"
    packed = f"{name}_packed"
    return packed if hasattr(experts, packed) else name


def load_checkpoint(
    experts: nn.Module,
    tensors: dict[TensorKey, torch.Tensor],
    prefix: str = "model.layers.1.block_sparse_moe.experts",
) -> None:
    """Feed checkpoint tensors to vLLM's ``RoutedExperts.weight_loader`` the way
    ``load_weights`` does: through each parameter's own ``weight_loader``."""
    for (expert, projection, suffix), tensor in tensors.items():
        name = expert_parameter_name(experts, projection, suffix)
        param = experts.get_parameter(name)
        param.weight_loader(
            param, tensor, f"{prefix}.{name}", shard_id=projection, expert_id=expert
        )


def expert_parameters(experts: nn.Module) -> dict[str, torch.Tensor]:
    """The four expert tensors, keyed by their native-MXFP4 names."""
    parameters = {}
    for name in EXPERT_PARAMETERS:
        stem, suffix = name.split("_", 1)
        projection = "w2" if stem == "w2" else "w1"
        parameters[name] = experts.get_parameter(
            expert_parameter_name(experts, projection, suffix)
        ).data
    return parameters


def load_and_decode(
    make_experts: Callable[[], nn.Module], planes: list[Plane]
) -> dict[str, torch.Tensor]:
    """Load each digit plane (``digit_planes``) through the real loader of a
    fresh layer (a layer takes each expert tensor once); per parameter byte,
    the checkpoint index it received, or UNWRITTEN."""
    decoded: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    for digit, plane in enumerate(planes):
        experts = make_experts()
        load_checkpoint(experts, plane)
        for name, param in expert_parameters(experts).items():
            value = param.to(torch.int64)
            if digit == 0:
                decoded[name] = torch.zeros_like(value)
                written[name] = torch.zeros_like(value, dtype=torch.bool)
            written[name] |= value != 0
            decoded[name] += (value - 1).clamp(min=0) * BASE**digit
    for name in decoded:
        decoded[name][~written[name]] = UNWRITTEN
    return decoded
