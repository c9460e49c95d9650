"""What the FP4 MoE kernels with 128 x 4-swizzled block scales assume about
the tensors a preparation hands them: FlashInfer's TRT-LLM kernel (NVFP4
and MXFP4 weights), its CuteDSL kernel, b12x, and vLLM's CUTLASS NVFP4 and
MXFP4 grouped GEMMs. Read from their sources (FlashInfer 0.7.2.post1's, as
installed with its csrc; vLLM's csrc from the vllm-project/vllm snapshot the
search index holds, newer than 0.33.0), per GEMM of one expert:

- Block scales are read in the 128 x 4 tile order of
  ``get_sf_out_offset_128x4`` (FlashInfer csrc nv_internal/tensorrt_llm/
  kernels/quantization_utils.cuh; CUTLASS's ``Sm1xxBlkScaledConfig`` is the
  same order, and vLLM's ``swizzle_blockscale`` writes it):
  ``stand_ins.flashinfer.unswizzled`` reads them back.
- Where expert e's scales start: the TRT-LLM kernel infers the scale vector
  from ``gemm1_weights_scale.numel()`` over ``experts x 2I x hidden``
  (trtllm_fused_moe_kernel_launcher.cu ``trtllm_fp4_block_scale_moe``) and
  vLLM's CUTLASS kernels offset expert e's scales by ``e * n * (k / 16)``
  (csrc/quantization/fp4/nvfp4_blockwise_moe_kernel.cu
  ``__get_group_gemm_starts``, 128-byte aligned): both read an expert's
  scales as exactly ``rows x cols`` elements (``UNPADDED``), which is a whole
  number of 128 x 4 tiles only when rows % 128 == 0 and cols % 4 == 0.
  CuteDSL views the padded tensor in its MMA layout
  (``convert_sf_to_mma_layout(m=padded rows, k=padded cols * 16)``) and b12x
  takes it as ``swizzle_blockscale`` pads it (``PADDED``).
- Row order of the weights: the TRT-LLM kernel runs MajorK shuffled weights
  (``use_shuffled_weight=true``) for an epilogue tile of 128 rows
  (trtllm_fused_moe_runner.cu: ``epilogueTileM = 128`` without DeepSeek FP8),
  a gated GEMM1 with [up; gate] rows interleaved one by one
  (FlashInfer's ``reorder_rows_for_gated_act_gemm``), both as FlashInfer's
  own Python helpers lay them out (``trtllm_gemm1_rows``, ``trtllm_rows``);
  CuteDSL reads GEMM1 as 64-row up/gate pairs (``cute_dsl_fused_moe``'s
  docstring: "Keep each interleaved 64-row up/gate pair together");
  CUTLASS and b12x read [gate; up] (b12x flips gate-first storage to its
  [up; gate] order in place at first use, ``_ensure_w13_kernel_order_inplace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.models.kimi_k3.preparation.stand_ins.flashinfer import (
    SF_COL_TILE,
    SF_ROW_TILE,
    padded_size,
    pads_of,
    unswizzled,
)

EPILOGUE_TILE_M = 128  # trtllm_fused_moe_runner.cu, non-DeepSeek FP8
CUTEDSL_ROW_PAIR = 64  # rows of up, then of gate, per GEMM1 row block
UNPADDED, PADDED = "unpadded", "padded"  # how the kernel steps over experts


def trtllm_rows(rows: int) -> Any:
    """The TRT-LLM kernel's row order of a ``rows``-row weight (or scale)
    matrix: FlashInfer's shuffle for the 128-row epilogue tile."""
    import torch
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    return get_shuffle_matrix_a_row_indices(torch.empty(rows, 1), EPILOGUE_TILE_M)


def trtllm_gemm1_rows(rows: int) -> Any:
    """The TRT-LLM kernel's row order of a gated GEMM1 stored [up; gate]:
    up and gate rows interleaved one by one, then shuffled."""
    import torch
    from flashinfer.fused_moe.core import (
        get_reorder_rows_for_gated_act_gemm_row_indices,
    )

    gated = get_reorder_rows_for_gated_act_gemm_row_indices(torch.empty(rows, 1))
    return gated[trtllm_rows(rows)]


def cutedsl_gemm1_rows(rows: int) -> Any:
    """CuteDSL's row order of a GEMM1 stored [up; gate]: 64 rows of up, 64 of
    gate, and so on."""
    import torch

    pairs = rows // (2 * CUTEDSL_ROW_PAIR)
    return torch.arange(rows).view(2, pairs, CUTEDSL_ROW_PAIR).transpose(0, 1)


@dataclass(frozen=True)
class Fp4Gemm:
    """One of a layer's two GEMMs as prepared for an FP4 kernel, and the
    loaded tensors as that kernel reads them (before the scale swizzle)."""

    name: str  # "w13" or "w2"
    weight: Any  # prepared packed weights, [experts, rows, K / 2]
    scales: Any  # prepared swizzled scales, any shape, experts first
    expected_weight: Any  # uint8 [experts, rows, K / 2]
    expected_scales: Any  # uint8 [experts, rows, K / group]
    steps: str  # UNPADDED or PADDED: the kernel's step between experts
    nan_bytes: tuple[int, ...]  # the scale encoding's NaN bytes

    def problems(self) -> list[str]:
        import torch

        found = []
        experts, rows, cols = self.expected_scales.shape
        where = f"{self.name} ({rows} rows, {cols} scale columns)"
        weight = self.weight.view(torch.uint8)
        if tuple(weight.shape) != tuple(self.expected_weight.shape):
            found.append(f"{where}: weights {tuple(weight.shape)}")
        elif not torch.equal(weight, self.expected_weight):
            found.append(f"{where}: weights are not the loaded ones in kernel order")
        scales = self.scales.view(torch.uint8).reshape(experts, -1)
        if self.steps == UNPADDED and (rows % SF_ROW_TILE or cols % SF_COL_TILE):
            found.append(
                f"{where}: the kernel steps {rows} x {cols} scales per expert, "
                f"not whole {SF_ROW_TILE} x {SF_COL_TILE} tiles"
            )
            return found
        if scales.shape[1] != padded_size(rows, cols):
            found.append(f"{where}: {scales.shape[1]} scales per expert")
            return found
        if not torch.equal(unswizzled(scales, rows, cols), self.expected_scales):
            found.append(f"{where}: the kernel reads other scales than the loaded")
        if bool(pads_of(scales, rows, cols).any()):
            found.append(f"{where}: the swizzle's pads are not zero")
        if any(bool((scales == byte).any()) for byte in self.nan_bytes):
            found.append(f"{where}: NaN scale bytes")
        return found
