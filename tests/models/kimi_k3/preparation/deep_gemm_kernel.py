"""What DeepGEMM's grouped FP8 x FP4 GEMM assumes about the MXFP4 weights and
scales a preparation hands it.

vLLM's ``DeepGemmFP4Experts.apply`` (fused_moe/experts/deep_gemm_moe.py)
runs ``m_grouped_fp8_fp4_gemm_nt_contiguous`` twice (w13: n = 2 x the rows,
k = the expert width; w2: n = the width, k = the rows) on ``(w.view(int8),
w_scale)`` with FP8 activations in groups of 128 (``recipe_a=(1, 128)``) and
weight scales in groups of 32 (``recipe_b=(1, 32)``). Read from DeepGEMM's
csrc (a newer snapshot than the 2.8.1 vLLM vendors), apis/gemm.hpp,
apis/layout.hpp and utils/layout.hpp:

- the weights are packed FP4, two values a byte, ``[experts, n, k / 2]``,
  K-major (``get_major_type_ab``: last stride 1) with the experts contiguous
  (``major_check``: stride 0 is n x k / 2); ``check_grouped_ab_fp8_fp4``
  doubles the last size to k;
- k is a multiple of 128 (asserted on SM120 for FP8 x FP4, the activations'
  groups; vLLM rounds the rows to 128 for this kernel,
  ``mxfp4_round_up_hidden_size_and_intermediate_size``);
- scales already in the kernel's layout (int32) are only checked
  (``transform_sf_into_required_layout``'s "(INT, 1, gran_k)" branch,
  ``check_sf_layout`` with the TMA stride check): ``[experts, n, ceil(k /
  (32 x 4))]``, MN-major (stride -2 is 1), the MN stride at least n rounded
  up to 16 bytes and a multiple of 4, the experts' stride the MN stride
  times the last size;
- each int32 holds four UE8M0 bytes, K group 4i + j in byte j (the packing
  ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` writes: a byte view of
  the int32s, little-endian); byte 255 is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.models.kimi_k3.preparation.stand_ins.deep_gemm import (
    UE8M0_PER_INT,
    tma_aligned,
)

WEIGHT_GROUP = 32  # recipe_b: one scale per 32 values along K
K_MULTIPLE = 128  # FP8 activations' groups (recipe_a)
UE8M0_NAN = 255


@dataclass(frozen=True)
class DeepGemmFp4Gemm:
    """One of a layer's two GEMMs as prepared for DeepGEMM."""

    name: str  # "w13" or "w2"
    weight: Any  # [experts, n, k / 2] packed FP4
    scales: Any  # packed UE8M0 int32
    size_k: int

    def problems(self) -> list[str]:
        """Where the prepared GEMM breaks what the kernel assumes."""
        import torch

        experts, n, half_k = self.weight.shape
        where = f"{self.name} (n {n}, k {self.size_k})"
        found = []
        if 2 * half_k != self.size_k:
            found.append(f"{where}: weights {tuple(self.weight.shape)}")
        if self.weight.stride(-1) != 1 or self.weight.stride(0) != n * half_k:
            found.append(f"{where}: weights not K-major with contiguous experts")
        if self.size_k % K_MULTIPLE:
            found.append(f"{where}: k is not a multiple of {K_MULTIPLE}")
        packed = -(-self.size_k // (WEIGHT_GROUP * UE8M0_PER_INT))
        scales = self.scales
        if scales.dtype != torch.int32 or tuple(scales.shape) != (experts, n, packed):
            found.append(
                f"{where}: scales {scales.dtype} {tuple(scales.shape)}, the kernel "
                f"reads int32 {(experts, n, packed)}"
            )
            return found
        mn_stride = scales.stride(-1)
        if (
            scales.stride(-2) != 1
            or mn_stride < tma_aligned(n, scales.element_size())
            or mn_stride % 4
            or scales.stride(0) != mn_stride * packed
        ):
            found.append(f"{where}: scales strides {scales.stride()} not MN-major TMA")
        return found

    def scale_bytes(self) -> Any:
        """The UE8M0 bytes the kernel reads, ``[experts, n, k / 32]``."""
        return self._bytes()[..., : self.groups]

    def scale_pads(self) -> Any:
        """The bytes past the last K group (DeepGEMM packs zeros there)."""
        return self._bytes()[..., self.groups :]

    def _bytes(self) -> Any:
        import torch

        # a row-major copy (.contiguous() keeps a size-1 dimension's stride)
        values = self.scales.new_empty(self.scales.shape).copy_(self.scales)
        return values.view(torch.uint8).reshape(*self.scales.shape[:2], -1)

    @property
    def groups(self) -> int:
        return self.size_k // WEIGHT_GROUP
