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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THREAD_K_MIN = 64  # the smallest thread_k of any thread configuration
THREAD_N_MIN = 128  # the smallest thread_n of any thread configuration
GROUP_BLOCK = 16  # group_blocks = group_size / 16


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
                    self.is_a_8bit,
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
