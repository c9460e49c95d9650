"""Marlin's compiled repacks, in the kernel's own tile order.

``gptq_marlin_repack``, ``awq_marlin_repack``
    csrc/quantization/marlin/gptq_marlin_repack.cu, awq_marlin_repack.cu:
    a [K / pack, N] (GPTQ, packed along K) or [K, N / pack] (AWQ, packed
    along N, AWQ's interleave) int32 matrix to Marlin's [K / 16, N * 16 /
    pack] tiles, values unchanged; the op checks K % 16, N % 64 and the
    input's shape (``STD_TORCH_CHECK``), as the stand-in does. The stand-in
    unpacks the values (vLLM's ``quant_utils.unpack_cols``) and lays them out
    as vLLM's Python reference of the op does,
    ``marlin_utils_test.marlin_weights`` with ``get_weight_perm``: what
    vLLM's kernel test (tests/kernels/quantization/test_marlin_gemm.py,
    ``test_gptq_marlin_repack`` and ``test_awq_marlin_repack``) holds the
    CUDA op to, bit for bit. For time, its permutation
    (``marlin_permute_weights``) is applied once per shape to the elements'
    indices and gathered with, and its packing is ``quant_utils.pack_cols``
    (the same shifts). So the repacked tensor is the one the GPU would hold;
    ``unrepacked`` is its exact inverse, for a test to read a prepared
    weight back in the layout it was repacked from.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MARLIN_TILE = 16  # rows of K per Marlin tile (marlin::tile_size)
TILE_N = 64  # marlin::tile_n_size: the repack's multiple of N

REPACK_SCHEMA = (
    "(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, "
    "bool is_a_8bit=False) -> Tensor"
)


def _pack(num_bits: int) -> int:
    return 32 // num_bits


@functools.cache
def _awq_order(num_bits: int) -> Any:
    """Where AWQ stores each of a packed int32's values (value i at position
    order[i]), read off vLLM's own ``awq_pack``."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        awq_pack,
        unpack_cols,
    )

    pack = _pack(num_bits)
    values = torch.arange(pack, dtype=torch.int32).reshape(1, pack)
    stored = unpack_cols(awq_pack(values, num_bits, 1, pack), num_bits, 1, pack)
    return torch.argsort(stored.reshape(-1))


def _gptq_values(b_q_weight: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """[K / pack, N] packed along K -> [K, N]."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols

    along_n = b_q_weight.T.contiguous()  # [N, K / pack]: pack along its columns
    return unpack_cols(along_n, num_bits, size_n, size_k).T.contiguous()


def _awq_values(b_q_weight: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """[K, N / pack] packed along N in AWQ's interleave -> [K, N]."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols

    stored = unpack_cols(b_q_weight, num_bits, size_k, size_n)
    order = _awq_order(num_bits)
    return stored.reshape(-1, order.numel())[:, order].reshape(size_k, size_n)


def _check(b_q_weight: Any, shape: tuple[int, int], size_k: int, size_n: int) -> None:
    """The op's own checks (gptq_marlin_repack.cu, awq_marlin_repack.cu)."""
    assert size_k % MARLIN_TILE == 0, f"size_k {size_k} % {MARLIN_TILE}"
    assert size_n % TILE_N == 0, f"size_n {size_n} % {TILE_N}"
    assert tuple(b_q_weight.shape) == shape, (tuple(b_q_weight.shape), shape)
    assert b_q_weight.is_contiguous(), "b_q_weight is not contiguous"


def _marlin_tiles(q_w: Any, size_k: int, size_n: int, num_bits: int, a8: bool) -> Any:
    """``marlin_weights``: its permutation (``marlin_permute_weights``,
    applied once per shape to element indices, ``_tile_positions``), then
    its packing (``quant_utils.pack_cols``, the same shifts)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_cols

    positions = _tile_positions(size_k, size_n, num_bits, a8)
    tiles = q_w.reshape(-1)[positions].reshape(size_k // MARLIN_TILE, -1)
    return pack_cols(tiles, num_bits, *tiles.shape)


def _gptq_marlin_repack(
    b_q_weight: Any, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
) -> Any:
    _check(b_q_weight, (size_k // _pack(num_bits), size_n), size_k, size_n)
    q_w = _gptq_values(b_q_weight, size_k, size_n, num_bits)
    return _marlin_tiles(q_w, size_k, size_n, num_bits, is_a_8bit)


def _awq_marlin_repack(
    b_q_weight: Any, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
) -> Any:
    _check(b_q_weight, (size_k, size_n // _pack(num_bits)), size_k, size_n)
    q_w = _awq_values(b_q_weight, size_k, size_n, num_bits)
    return _marlin_tiles(q_w, size_k, size_n, num_bits, is_a_8bit)


@functools.cache
def _tile_positions(size_k: int, size_n: int, num_bits: int, a8: bool) -> Any:
    """Where ``marlin_weights`` puts each element of a [K, N] matrix: its
    permutation applied to the elements' flat indices."""
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        marlin_permute_weights,
    )

    from vllm_kimi_k3_moe.compat import (
        marlin_8bit_activation_kwargs,
        marlin_weight_perm,
    )

    index = torch.arange(size_k * size_n).reshape(size_k, size_n)
    perm = marlin_weight_perm(num_bits, a8)
    a8_kwargs = marlin_8bit_activation_kwargs(a8)
    moved = marlin_permute_weights(index, size_k, size_n, perm, **a8_kwargs)
    return moved.reshape(-1)


def unrepacked(
    repacked: Any, size_k: int, num_bits: int, along_k: bool, is_a_8bit: bool = False
) -> Any:
    """A Marlin-repacked MoE weight ``[E, K / 16, N * 16 / pack]`` read back
    in the layout it was repacked from: ``[E, K / pack, N]`` packed along K
    (``along_k``, GPTQ), else ``[E, K, N / pack]`` (AWQ)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        awq_pack,
        gptq_pack,
        unpack_cols,
    )

    pack = _pack(num_bits)
    experts = repacked.shape[0]
    size_n = repacked.shape[-1] * pack // MARLIN_TILE
    positions = _tile_positions(size_k, size_n, num_bits, is_a_8bit)
    tile_rows = experts * size_k // MARLIN_TILE
    flat = repacked.reshape(tile_rows, -1).contiguous()
    tiles = unpack_cols(flat, num_bits, tile_rows, size_n * MARLIN_TILE)
    q_w = torch.empty_like(tiles).reshape(experts, -1)
    q_w[:, positions] = tiles.reshape(experts, -1)
    # packing runs along K (GPTQ) or along N (AWQ) within each expert alone
    rows = q_w.reshape(experts * size_k, size_n)
    packing = gptq_pack if along_k else awq_pack
    return packing(rows, num_bits, experts * size_k, size_n).reshape(
        experts, size_k // pack if along_k else size_k, -1
    )


@contextmanager
def stand_ins() -> Iterator[None]:
    """The repacks, defined as ``torch.ops._C.*`` for the block."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    try:
        for name, impl in (
            ("gptq_marlin_repack", _gptq_marlin_repack),
            ("awq_marlin_repack", _awq_marlin_repack),
        ):
            library.define(name + REPACK_SCHEMA)
            library.impl(name, impl, "CPU")
        yield
    finally:
        library._destroy()
