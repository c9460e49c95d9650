"""What Marlin's MoE GEMM assumes about the tensors a preparation hands it.

Read from the kernel's source, ``moe_wna16_marlin_gemm`` and ``marlin_mm``
in vLLM's csrc/moe/marlin_moe_wna16/ops.cu (every Marlin MoE path, integer,
FP4 and FP8 weights alike, runs it; vLLM's Python calls it through
``fused_marlin_moe``), for one GEMM of size_n outputs over size_k inputs
(w13: size_n = 2 x the rows, size_k = the expert width; w2: size_n = the
width, size_k = the rows):

- the scales are ``[experts, groups, size_n]``; with more than one group the
  kernel takes the group size to be ``size_k / groups`` (which must divide),
  with one group it reads per-channel scales (group -1);
- it reads them in the order vLLM's ``marlin_permute_scales`` writes for
  that group (``get_scale_perms``: grouped, or per channel, and always per
  channel with 8-bit activations);
- every thread configuration it may pick (``small_batch_thread_configs``,
  ``large_batch_thread_configs``) has thread_k 64 or 128 and thread_n 128
  or 256, and ``is_valid_config`` requires size_k % thread_k == 0 and
  size_n % thread_n == 0; a group is a whole number of 16-row blocks
  (``group_blocks``) dividing size_k;
- packed zero points, where there are any, are ``[experts, groups,
  size_n / pack]``.

For FP weights (csrc/moe/marlin_moe_wna16/generate_kernels.py, a newer
snapshot than 0.33.0's; csrc/quantization/marlin/dequant.h):

- the kernel is compiled for groups of 16 only with NVFP4 (FP8 E4M3 scales),
  32 only with MXFP4 (E8M0 scales), and per channel or 128 only with FP8
  weights (``QUANT_CONFIGS``' group_blocks, 16 rows each);
- FP scale bytes are read four at a time, bytes 0 and 2 into the first pair
  of values, 1 and 3 into the second (``dequant_fp8_scales``: "reverse
  indexing is intentional"): vLLM stores each four in the order 0, 2, 1, 3;
- an E8M0 byte becomes a BF16 exponent (byte 255 is NaN);
- NVFP4 scales are FP8 E4M3 read as the kernel's S0E5M3 of the scale times
  2^7 (``nvfp4_marlin_process_scales``' docstring), times one power of two
  for the whole layer (vLLM divides the global scale by it);
- FP8 weights are widened to BF16 by a bit shift without their exponent
  bias (``dequant<..., kFE4M3fn, true>``, the scaled path), so the scale
  carries it: BF16's 2^120 (FP16's 2^8), which vLLM folds into the scales
  (``fp8_fused_exponent_bias_into_scales``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.compat import marlin_8bit_activation_kwargs

THREAD_K_MIN = 64  # the smallest thread_k of any thread configuration
THREAD_N_MIN = 128  # the smallest thread_n of any thread configuration
GROUP_BLOCK = 16  # group_blocks = group_size / 16
# the groups the kernel is compiled for, by weight type (-1: per channel)
FP8_GROUPS = (-1, 128)
NVFP4_GROUPS = (16,)
MXFP4_GROUPS = (32,)
FP_SCALE_ORDER = (0, 2, 1, 3)  # how each four FP scale bytes are stored
BF16_FP8_EXPONENT_BIAS = 2.0**120  # 2^(2^7 - 2^3): BF16's bias less E4M3's
NVFP4_SCALE_SHIFT = 2**7  # S0E5M3 holds the E4M3 scale times 2^7


def _in_read_order(scales: Any) -> Any:
    """FP scales as the kernel reads them: each four stored bytes taken in
    ``FP_SCALE_ORDER`` (its own inverse)."""
    order = list(FP_SCALE_ORDER)
    return scales.reshape(-1, len(order))[:, order].reshape(scales.shape)


def e8m0_scales(scales: Any) -> Any:
    """MXFP4's E8M0 scales as values, in ``marlin_permute_scales``' layout."""
    import torch

    return _in_read_order(scales.view(torch.float8_e8m0fnu)).float()


def nvfp4_scales(scales: Any) -> Any:
    """NVFP4's stored scale bytes decoded as the kernel's S0E5M3 (the byte
    is the high byte of an FP16 shifted left by one, sign dropped), divided
    by 2^7: the checkpoint's scales times the layer's power of two."""
    import torch

    half = (scales.view(torch.uint8).to(torch.int16) << 7).view(torch.float16)
    return _in_read_order(half).float() / NVFP4_SCALE_SHIFT


def fp8_scales(scales: Any) -> Any:
    """FP8 weights' BF16 scales without the exponent bias they carry."""
    import torch

    assert scales.dtype == torch.bfloat16, scales.dtype
    return scales.float() / BF16_FP8_EXPONENT_BIAS


def kernel_group(size_k: int, groups: int) -> int:
    """The group size the kernel infers: ``size_k / groups``, or -1 (per
    channel) for one group."""
    return size_k // groups if groups > 1 else -1


@dataclass(frozen=True)
class MarlinGemm:
    """One of a layer's two GEMMs as prepared for Marlin."""

    name: str  # "w13" or "w2"
    size_k: int
    size_n: int
    scales: Any  # the prepared scales, [experts, groups, size_n]
    # the loaded scales in K-first order, zero-padded to the prepared rows:
    # what the kernel must read, once laid out for its group
    loaded_scales: Any
    is_a_8bit: bool = False
    zeros: Any = None  # the prepared packed zero points, if any
    pack: int = 8  # values per int32 of the zero points
    # INT8 activations: vLLM stores grouped scales as int16 steps of the
    # layer's largest (``marlin_act_int8_process_scales``) in their place
    int8_scales: bool = False
    # FP weights: the groups the kernel is compiled for (empty: unchecked),
    # and the values the kernel reads from the stored scales (``e8m0_scales``
    # ...), compared with the loaded scales' values; NVFP4's are those times
    # one power of two for the layer (``common_power_of_two``)
    groups: tuple[int, ...] = ()
    read: Callable[[Any], Any] | None = None
    common_power_of_two: bool = False

    def problems(self) -> list[str]:
        """Where the prepared GEMM breaks what the kernel assumes."""
        import torch

        found = []
        where = f"{self.name} (size_k {self.size_k}, size_n {self.size_n})"
        if self.size_k % THREAD_K_MIN or self.size_n % THREAD_N_MIN:
            found.append(
                f"{where}: no thread configuration divides it (size_k % "
                f"{THREAD_K_MIN}, size_n % {THREAD_N_MIN})"
            )
        groups = self.scales.shape[1]
        if tuple(self.scales.shape[1:]) != (groups, self.size_n):
            found.append(f"{where}: scales {tuple(self.scales.shape)}")
            return found
        group = kernel_group(self.size_k, groups)
        if group != -1 and (self.size_k % groups or group % GROUP_BLOCK):
            found.append(f"{where}: {groups} scale groups do not split size_k")
            return found
        if self.groups and group not in self.groups:
            found.append(
                f"{where}: the kernel is compiled for groups of {self.groups}, "
                f"not {group}"
            )
        if self.read is not None:
            found += self.fp_scale_problems(where, group)
            return found
        if not self.scales_read_right(group):
            found.append(
                f"{where}: the kernel reads groups of {group} "
                "(size_k / scale rows), the scales are not laid out for them"
            )
        if not self.int8_scales and not torch.isfinite(self.scales.float()).all():
            found.append(f"{where}: scales not finite")
        if self.zeros is not None and tuple(self.zeros.shape[1:]) != (
            groups,
            self.size_n // self.pack,
        ):
            found.append(f"{where}: zero points {tuple(self.zeros.shape)}")
        return found

    def fp_scale_problems(self, where: str, group: int) -> list[str]:
        """FP scales: the values the kernel reads, finite, are the loaded
        ones laid out for the group it infers."""
        import torch

        assert self.read is not None
        values = self.read(self.scales)
        if not torch.isfinite(values).all():
            return [f"{where}: scales not finite"]
        expected = self.laid_out(self.loaded_scales.float(), group)
        if self.common_power_of_two:
            expected = expected * _common_power_of_two(values, expected)
        if not torch.equal(values, expected):
            return [
                f"{where}: the kernel reads groups of {group} (size_k / scale "
                "rows), the scales it reads are not the loaded ones laid out "
                "for them"
            ]
        return []

    def laid_out(self, scales: Any, group: int) -> Any:
        """K-first ``[experts, groups, size_n]`` scales in the order
        ``marlin_permute_scales`` writes for ``group``."""
        import torch
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_permute_scales,
        )

        return torch.stack(
            [
                marlin_permute_scales(
                    expert.contiguous(), self.size_k, self.size_n, group
                )
                for expert in scales
            ]
        )

    def scales_read_right(self, group: int) -> bool:
        """Whether the prepared scales are the loaded ones as vLLM's own
        permutation lays them out for the group the kernel infers."""
        import torch
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_permute_scales,
        )

        expected = torch.stack(
            [
                marlin_permute_scales(
                    expert.contiguous(),
                    self.size_k,
                    self.size_n,
                    group,
                    **marlin_8bit_activation_kwargs(self.is_a_8bit),
                )
                for expert in self.loaded_scales
            ]
        )
        expected = expected.to(self.scales.dtype)
        if self.int8_scales and self.scales.shape[1] > 1:
            from vllm.model_executor.layers.quantization.utils.marlin_utils import (
                marlin_act_int8_process_scales,
            )

            expected = marlin_act_int8_process_scales(expected)[0]
            return torch.equal(
                expected.view(torch.int16), self.scales.view(torch.int16)
            )
        return torch.equal(expected, self.scales)


def _common_power_of_two(values: Any, expected: Any) -> float:
    """The power of two the first non-zero ``values`` is its ``expected``
    times (1 where all are zero; NaN where it is none, so that nothing
    equals it): the caller compares all of them with it."""
    import math

    nonzero = _first_nonzero(expected)
    if nonzero is None:
        return 1.0
    ratio = float(values.reshape(-1)[nonzero] / expected.reshape(-1)[nonzero])
    return ratio if ratio > 0 and math.log2(ratio).is_integer() else math.nan


def _first_nonzero(tensor: Any) -> int | None:
    """The flat index of ``tensor``'s first non-zero element, if any."""
    flat = tensor.reshape(-1)
    found = flat.nonzero()
    return int(found[0]) if found.numel() else None
