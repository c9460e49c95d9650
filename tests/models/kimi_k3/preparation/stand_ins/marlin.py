"""Marlin's compiled repacks, kept as values in the op's output shape.

``gptq_marlin_repack``, ``awq_marlin_repack``
    csrc/quantization/marlin/gptq_marlin_repack.cu, awq_marlin_repack.cu:
    a [K / pack, N] (GPTQ, packed along K) or [K, N / pack] (AWQ, packed
    along N) int32 matrix to Marlin's [K / 16, N * 16 / pack] tiles, values
    unchanged. The stand-in returns the input's values in that shape (the
    element count is the same), row-major: ``unrepacked`` reads them back in
    the layout they were repacked from. vLLM's own fake
    (``vllm._custom_ops``) gives the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MARLIN_TILE = 16  # rows of K per Marlin tile (marlin::tile_size)

REPACK_SCHEMA = (
    "(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, "
    "bool is_a_8bit=False) -> Tensor"
)


def _marlin_repack(
    b_q_weight: Any, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
) -> Any:
    pack = 32 // num_bits
    return b_q_weight.reshape(size_k // MARLIN_TILE, size_n * MARLIN_TILE // pack)


def unrepacked(repacked: Any, size_k: int, num_bits: int, along_k: bool) -> Any:
    """A Marlin-repacked MoE weight ``[E, K / 16, N * 16 / pack]`` read back
    in the layout it was repacked from: ``[E, K / pack, N]`` packed along K
    (``along_k``, GPTQ), else ``[E, K, N / pack]`` (AWQ)."""
    pack = 32 // num_bits
    experts = repacked.shape[0]
    if along_k:
        return repacked.reshape(experts, size_k // pack, -1)
    return repacked.reshape(experts, size_k, -1)


@contextmanager
def stand_ins() -> Iterator[None]:
    """The repacks, defined as ``torch.ops._C.*`` for the block."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    try:
        for name in ("gptq_marlin_repack", "awq_marlin_repack"):
            library.define(name + REPACK_SCHEMA)
            library.impl(name, _marlin_repack, "CPU")
        yield
    finally:
        library._destroy()
