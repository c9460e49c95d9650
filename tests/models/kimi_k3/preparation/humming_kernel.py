"""What Humming's MoE GEMM assumes about the tensors a preparation hands it.

Read from humming-kernels 0.1.19 (the version vLLM 0.33.0 requires), for
one GEMM of ``shape_n`` outputs over ``shape_k`` inputs (w13: 2 x the rows
by the width; w2: the width by the rows), as its ``LayerConfig`` describes
it (``humming/transform.py`` ``prepare_layer_config``):

- the kernel runs the padded shapes, ``shape_n`` and ``shape_k`` (the
  launcher's weights are ``[experts, shape_k / pack_k, shape_n * pack_k *
  bits / 32]``, humming/csrc/launcher/tensor.h), and masks activations and
  outputs to the unpadded ones (``pad_shape_n``, ``pad_shape_k``): a pad is
  resident and computed on;
- the repacked tile layout needs ``shape_n % 64 == 0`` and ``shape_k %
  (2 * 256 / activation bits) == 0`` (``transform_humming_weight``), and the
  ``block_shape`` its heuristics pick for a token count (``humming.tune``)
  tiles n and k (the stand-in records them: ``stand_ins.humming.TILES``);
- the group size is compiled into the config (``weight_scale_group_size``,
  0 per channel): scales are ``[experts, shape_k / group, shape_n]`` in the
  order ``transform_humming_weight_scale`` writes for the config, and a group
  must divide ``shape_k``;
- zero points, where there are any, in the order
  ``transform_humming_zero_point`` writes.

``HummingGemm.problems`` reads the prepared weights back through the repack
stand-in (``stand_ins.humming.unrepacked``) and lays the loaded scales and
zero points out with Humming's own layout functions for the config: what it
checks of those is that they are the loaded ones, with zero pads, for the
group the config compiles in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TILE_N = 64  # transform_humming_weight: padded_shape_n % 64
TILE_K_BITS = 512  # ... padded_shape_k % (2 * 256 / activation bits)
FP8_ROUNDING = 2.0**-4  # float8_e4m3fn: 3 mantissa bits, half an ulp


def _pad(tensor: Any, rows: int, cols: int, value: int = 0) -> Any:
    import torch.nn.functional as F

    return F.pad(
        tensor, (0, cols - tensor.shape[-1], 0, rows - tensor.shape[-2]), value=value
    )


@dataclass(frozen=True)
class HummingGemm:
    """One of a layer's two GEMMs as prepared for Humming, and as loaded
    (``loaded``: codes ``[experts, n, k]``, scales ``[experts, n, groups]``,
    zero-point codes, bits, group; see ``test_humming.Loaded``)."""

    name: str  # "w13" or "w2"
    config: Any  # humming.config.LayerConfig
    weight: Any
    scales: Any
    zeros: Any
    loaded: Any
    # the (block_m, block_n, block_k) tiles Humming's heuristics chose for it
    tiles: tuple[tuple[int, int, int], ...] = ()

    def problems(self, width: int, rows: int) -> list[str]:
        """Where the prepared GEMM breaks what the kernel assumes; run on the
        stand-in Hopper with Humming's ops stood in (``on_hopper``, ``ops``)."""
        config = self.config
        n, k = (2 * rows, width) if self.name == "w13" else (width, rows)
        where = f"{self.name} ({n} x {k})"
        found = []
        unpadded = (
            config.shape_n - config.pad_shape_n,
            config.shape_k - config.pad_shape_k,
        )
        if unpadded != (n, k):
            return [f"{where}: Humming's config is for {unpadded}"]
        if config.pad_shape_n or config.pad_shape_k:
            found.append(
                f"{where}: Humming pads it to {config.shape_n} x {config.shape_k}: "
                "resident, with a second copy while it pads"
            )
        if config.shape_n % TILE_N or config.shape_k % (
            TILE_K_BITS // config.a_dtype.num_bits
        ):
            found.append(
                f"{where}: {config.shape_n} x {config.shape_k} is no whole tile"
            )
        for tile in self.tiles:
            if config.shape_n % tile[1] or config.shape_k % tile[2]:
                shape = f"{config.shape_n} x {config.shape_k}"
                found.append(f"{where}: Humming's tile {tile} splits {shape}")
        group = config.weight_scale_group_size
        if group != self.loaded.group:
            found.append(
                f"{where}: groups of {group}, the checkpoint's {self.loaded.group}"
            )
        elif group and config.shape_k % group:
            found.append(f"{where}: groups of {group} do not divide {config.shape_k}")
        found += self._weights(where)
        if self.loaded.scales is not None:
            found += self._scales(where)
        if self.loaded.zeros is not None:
            found += self._zeros(where)
        return found

    def _codes(self) -> Any:
        from tests.models.kimi_k3.preparation.stand_ins.humming import (
            unpack,
            unrepacked,
        )

        bits = self.config.b_dtype.num_bits
        return unpack(unrepacked(self.weight, self.config.shape_n), bits)

    def _weights(self, where: str) -> list[str]:
        import torch

        config = self.config
        if config.b_dtype.num_bits != self.loaded.bits:
            return [f"{where}: {config.b_dtype} weights, not {self.loaded.bits}-bit"]
        codes = self._codes()
        n, k = self.loaded.codes.shape[1:]
        if bool(codes[:, n:].any() or codes[:, :, k:].any()):
            return [f"{where}: Humming's pads are not zero codes"]
        codes = codes[:, :n, :k]
        if self.loaded.tensor_scales is None:
            if not torch.equal(codes, self.loaded.codes):
                return [f"{where}: weights are not the loaded codes"]
            return []
        # FP8 per tensor: w1 and w3 requantized to the larger of their scales
        before = _fp8(self.loaded.codes) * _per_row(self.loaded.tensor_scales, n)
        after = _fp8(codes) * _per_row(self.weight_scale_of_tensor(), n)
        if not bool(((after - before).abs() <= FP8_ROUNDING * before.abs()).all()):
            return [f"{where}: requantized weights are not the loaded ones"]
        return []

    def weight_scale_of_tensor(self) -> Any:
        return self.scales.reshape(self.scales.shape[0], -1)

    def _scales(self, where: str) -> list[str]:
        import torch
        from humming import dtypes
        from humming.config import WeightScaleType
        from humming.transform import transform_humming_weight_scale

        config = self.config
        if config.use_block_scaled_mma or config.use_int_weight_scale:
            return [f"{where}: a scale layout this test does not read ({config})"]
        dtype = dtypes.torch_dtype_map[config.bs_dtype]
        groups = (
            config.shape_k // config.weight_scale_group_size
            if config.weight_scale_group_size
            else 1
        )
        scales = self.loaded.scales
        if dtype == torch.float8_e8m0fnu:  # pads are 2^0: byte 127
            padded = _pad(scales.view(torch.uint8), config.shape_n, groups, 127)
            padded = padded.view(dtype)
        else:
            padded = _pad(scales.to(dtype), config.shape_n, groups)
        expected = transform_humming_weight_scale(
            padded,
            to_apply_on_c=config.should_apply_bs_on_c,
            is_blockwise=config.weight_scale_type == WeightScaleType.BLOCK,
        )
        prepared = self.scales
        if prepared is None or prepared.shape != expected.shape:
            shape = None if prepared is None else tuple(prepared.shape)
            return [f"{where}: scales {shape}, not {tuple(expected.shape)}"]
        if not torch.equal(prepared.view(torch.uint8), expected.view(torch.uint8)):
            return [f"{where}: the kernel reads other scales than the loaded ones"]
        return []

    def _zeros(self, where: str) -> list[str]:
        import torch
        from humming.transform import transform_humming_zero_point

        from tests.models.kimi_k3.preparation.stand_ins.humming import pack

        config = self.config
        groups = config.shape_k // config.weight_scale_group_size
        codes = _pad(self.loaded.zeros, config.shape_n, groups)
        packed = pack(codes.transpose(1, 2).contiguous(), config.b_dtype.num_bits)
        expected = transform_humming_zero_point(
            packed.transpose(1, 2).contiguous(), config.b_dtype, packed=True
        )
        if self.zeros is None or not torch.equal(self.zeros, expected):
            return [f"{where}: the kernel reads other zero points than the loaded"]
        return []


def _fp8(codes: Any) -> Any:
    import torch

    return codes.to(torch.uint8).view(torch.float8_e4m3fn).double()


def _per_row(scales: Any, rows: int) -> Any:
    """Per-tensor scales ``[experts, shards]`` as one per row of ``rows``."""
    experts, shards = scales.shape
    per_row = scales.double().repeat_interleave(rows // shards, dim=1)
    return per_row.reshape(experts, rows, 1)
