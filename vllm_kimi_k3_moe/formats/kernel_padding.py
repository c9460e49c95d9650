"""What MoE kernels do to a GPU's rows when they prepare their weights.

Some of vLLM 0.33.0's MoE kernels pad each expert's intermediate rows again
in ``process_weights_after_loading``, into a new tensor that then stays
resident (the allocated one is held too while they copy): the plugin
allocates what they keep instead (``PartitionRule.resident``). Each
multiple here is what vLLM's preparation code pads to, and the
preparation tests (``tests/models/kimi_k3/preparation``) run that code on
the CPU at every partition the plugin chooses and hold the rows it keeps to
the plugin's allocation.

Plain Python: nothing here imports torch or vLLM.
"""

from __future__ import annotations

from typing import Any

# Humming, every format: ``quantization/utils/humming/moe.py``
# ``_prepare_and_transform_sublayer`` pads w13's outputs (2 x rows) to a
# multiple of 256 and w2's inputs (the rows) to 128.
HUMMING_ROWS = 128
# Gated FP4 kernels pad each of gate and up to a multiple of 64:
# ``flashinfer_fp4_moe`` (``align_fp4_moe_weights_for_fi(min_alignment=64)``
# for FlashInfer TRT-LLM and CuteDSL), ``b12x_moe._pad_gated_weights``, and
# ``marlin_utils_fp4.prepare_nvfp4_moe_layer_for_marlin`` (widths that are a
# multiple of 128, as Kimi-K3's 3584).
GATED_FP4_ROWS = 64

BACKEND_ATTRIBUTES = (
    "mxfp4_backend",
    "fp8_backend",
    "nvfp4_backend",
    "wna16_backend",
    "wna16_moe_backend",
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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def humming_keeps(method: Any, n: int) -> int:
    """The rows Humming keeps of a partition of ``n``; any other kernel's
    as allocated, unless its format's rule says otherwise."""
    return round_up(n, HUMMING_ROWS) if backend_name(method) == "humming" else n
