"""What MoE kernels do to a GPU's rows when they prepare their weights.

Some of vLLM 0.33.0's MoE kernels pad each expert's intermediate rows again
in ``process_weights_after_loading``, into a new tensor that then stays
resident (the allocated one is held too while they copy): the plugin
allocates what they keep instead (``PartitionRule.resident``). Each
multiple here is what vLLM's preparation code pads to, and the
preparation tests (``tests/models/kimi_k3/preparation``) run that code on
the CPU at every partition the plugin chooses and hold the rows it keeps to
the plugin's allocation.

Plain Python when imported: vLLM's own helpers are imported inside the calls.
"""

from __future__ import annotations

from typing import Any

# Humming, every format: ``quantization/utils/humming/moe.py``
# ``_prepare_and_transform_sublayer`` pads w13's outputs (2 x rows) to a
# multiple of 256 and w2's inputs (the rows) to 128.
HUMMING_ROWS = 128
# NVFP4's gated kernels pad each of gate and up to a multiple of 64:
# ``flashinfer_fp4_moe`` (``align_fp4_moe_weights_for_fi(min_alignment=64)``
# for FlashInfer TRT-LLM and CuteDSL) and ``b12x_moe._pad_gated_weights``.
GATED_FP4_ROWS = 64
NVFP4_PADDING_GATED = ("flashinfer_trtllm", "flashinfer_cutedsl", "b12x")
# Marlin, every format, pads the rows to its thread tiles, a whole number of
# the format's groups along them (``marlin_moe_padded_intermediate``, which
# ``int_wna16``, ``marlin_utils_fp8`` and ``marlin_utils_fp4`` call or
# restate for widths that are a multiple of 128, as Kimi-K3's 3584).
MARLIN = ("marlin", "batched_marlin")

# Where vLLM 0.33.0's MoE methods keep the backend they selected.
# vLLM's CUTLASS grouped GEMM for FP8 (``TritonOrCutlassExperts``) reads its
# operands 128 bits at a time along K (csrc grouped_mm_c3x.cuh: AlignmentAB =
# 128 / 8 bits): w2's K is the rows, so a partition of rows not a multiple of
# 16 FP8 values is refused by the kernel, not padded.
CUTLASS_FP8_ROWS = 16

BACKEND_ATTRIBUTES = (
    "mxfp4_backend",
    "fp8_backend",
    "nvfp4_backend",
    "mxfp8_backend",
    "wna16_backend",
    "wna16_moe_backend",
    "int8_backend",
    "w4a8_backend",
    "unquantized_backend",
)


def backend_name(method: Any) -> str:
    """The MoE kernel ``method`` selected, as vLLM's backend enums name it."""
    if getattr(method, "use_cutlass_mxfp4", False):
        return "cutlass_mxfp4_mxfp4"
    for attribute in BACKEND_ATTRIBUTES:
        backend = getattr(method, attribute, None)
        if backend is not None:
            return str(getattr(backend, "name", backend)).lower()
    return "unknown backend"


def kernel_keeps(method: Any, n: int, group: int) -> int:
    """The rows ``method``'s kernel keeps of a partition of ``n`` once its
    weight preparation ran; ``group``: the rows that share a scale (or a
    packed element) along them."""
    from vllm.utils.math_utils import round_up

    backend = backend_name(method)
    if backend in MARLIN:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_moe_padded_intermediate,
        )

        return marlin_moe_padded_intermediate(n, group)
    if backend == "humming":
        return round_up(n, HUMMING_ROWS)
    if backend in NVFP4_PADDING_GATED and hasattr(method, "nvfp4_backend"):
        return round_up(n, GATED_FP4_ROWS)
    return n


def kernel_takes(method: Any, n: int) -> bool:
    """Whether ``method``'s kernel runs a partition of ``n`` rows at all
    (where no check of vLLM's refuses it before)."""
    if backend_name(method) == "vllm_cutlass" and hasattr(method, "fp8_backend"):
        return n % CUTLASS_FP8_ROWS == 0
    return True
