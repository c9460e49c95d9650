"""Stand-ins for the compiled ops a GPU kernel's weight preparation calls,
the one place the preparation tests fake anything.

vLLM's CUDA wheel on a CPU box loads no ``vllm._C`` (``No module named
'vllm._C'``), so ``torch.ops._C.*`` does not exist and each kernel's
``process_weights_after_loading`` stops at its first compiled op. Every other
step of the preparation (pads, transposes, scale permutations, swizzles,
config rewrites) is vLLM's own Python and runs here as on the GPU.

Each stand-in is defined with the op's schema for the ``with`` block and
removed on exit. Those that stand for a repack (a pure rearrangement of the
same values into the kernel's tile order) keep every value: they return the
input's values in the op's output shape (same element count), row-major, so
a check can read the tensor back in the layout it had before the repack and
see where each value went (``unrepacked``). What the real op guarantees, and
the stand-in does not reproduce, is the tile order inside that shape: a
layout the kernel was compiled for, which only a GPU run shows.

``gptq_marlin_repack``, ``awq_marlin_repack``
    csrc/quantization/marlin/gptq_marlin_repack.cu, awq_marlin_repack.cu:
    a [K / pack, N] (GPTQ, packed along K) or [K, N / pack] (AWQ, packed
    along N) int32 matrix to Marlin's [K / 16, N * 16 / pack] tiles, values
    unchanged. vLLM's own fake (``vllm._custom_ops``) gives the same shape.
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
def compiled_ops_on_cpu() -> Iterator[None]:
    """The stand-ins above, defined as ``torch.ops._C.*`` for the block."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    try:
        for name in ("gptq_marlin_repack", "awq_marlin_repack"):
            library.define(name + REPACK_SCHEMA)
            library.impl(name, _marlin_repack, "CPU")
        yield
    finally:
        library._destroy()
