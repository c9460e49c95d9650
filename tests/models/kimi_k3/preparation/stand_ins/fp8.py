"""vLLM's compiled static FP8 quantization, computing its values.

``static_scaled_fp8_quant``
    csrc/quantization/w8a8/fp8/common.cu: writes ``input`` times the
    reciprocal of ``scale``, clamped to FP8 E4M3's largest magnitude (448)
    and converted to E4M3, into ``result``. vLLM's FP8 MoE methods call it
    at weight preparation for per-tensor weights only
    (``fp8_utils.process_fp8_weight_tensor_strategy_moe``: w1 and w3 of each
    expert dequantized with their own scale and requantized with the larger
    one), with a one-element scale. Not a rearrangement: the stand-in
    computes the same, in FP32 with torch's conversion to E4M3 (round to
    nearest even, saturated by the clamp), per tensor only, and the tests
    hold its output to the loaded weights within E4M3's rounding, never to
    this formula.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

E4M3_MAX = 448.0

SCHEMA = (
    "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
    "SymInt[]? group_shape=None) -> ()"
)


def _static_scaled_fp8_quant(
    result: Any, input: Any, scale: Any, group_shape: Any = None
) -> None:
    import torch

    assert scale.numel() == 1, "the stand-in quantizes per tensor only"
    assert result.dtype == torch.float8_e4m3fn, result.dtype
    scaled = input.float() * scale.float().reciprocal()
    result.copy_(scaled.clamp(-E4M3_MAX, E4M3_MAX).to(result.dtype))


@contextmanager
def stand_ins() -> Iterator[None]:
    """The op, defined as ``torch.ops._C.static_scaled_fp8_quant`` for the
    block."""
    import torch

    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define(SCHEMA)
        library.impl("static_scaled_fp8_quant", _static_scaled_fp8_quant, "CPU")
        yield
    finally:
        library._destroy()
