"""Where a GPU's intermediate rows sit in its routed experts' tensors, for
holding prepared tensors to the loaded ones.

w13 holds gate then up, each ``rows`` long, along one dimension (the
outputs: dimension 1 of vLLM's ``[E, 2 x rows, K]``, the last of a K-first
``[E, groups, 2 x rows]``); w2 takes the rows as its inputs. A preparation
that pads the rows pads gate and up each (Marlin's ``_moe_pad_shard_rows``,
``pad_w13``); the rows a GPU does not hold (its allocation past its share of
the checkpoint, or all of them on a GPU that holds none) must stay zero.
"""

from __future__ import annotations

from typing import Any


def pad_to(tensor: Any, size: int, dim: int) -> Any:
    """``tensor`` zero-padded along ``dim`` to ``size``."""
    import torch

    dim = dim % tensor.dim()
    pads = [0, 0] * (tensor.dim() - dim - 1) + [0, size - tensor.shape[dim]]
    return torch.nn.functional.pad(tensor, pads)


def halves(tensor: Any, dim: int) -> list[Any]:
    """w13's gate and up along ``dim``."""
    return list(tensor.chunk(2, dim))


def pad_gate_and_up(tensor: Any, rows: int, dim: int) -> Any:
    """w13 with gate and up each zero-padded to ``rows`` along ``dim``."""
    import torch

    return torch.cat([pad_to(half, rows, dim) for half in halves(tensor, dim)], dim)


def not_held(tensor: Any, held: int, dim: int, gated: bool) -> list[Any]:
    """The parts of ``tensor`` past the first ``held`` rows along ``dim``
    (of gate and of up, where ``gated``)."""
    parts = halves(tensor, dim) if gated else [tensor]
    return [
        part.narrow(dim % part.dim(), held, part.shape[dim] - held) for part in parts
    ]
