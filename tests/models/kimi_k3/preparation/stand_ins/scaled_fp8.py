"""vLLM's compiled static FP8 quantization, as vLLM's own torch version of it.

``_C::static_scaled_fp8_quant`` (``vllm._custom_ops.scaled_fp8_quant`` with a
scale)
    csrc/quantization/w8a8/fp8/common.cu: each value times 1 / scale,
    clamped to float8_e4m3fn's range, rounded to it. The FP8 per-tensor
    preparation (``fp8_utils.process_fp8_weight_tensor_strategy_moe``)
    requantizes each of w1 and w3 with the larger of their two scales
    through it. It computes values (it is not a rearrangement): the
    stand-in is vLLM's ``QuantFP8.forward_native`` for a static per-tensor
    scale, the same arithmetic in torch; a test holds what it writes to the
    loaded weights within FP8's rounding, not bit for bit. Defined only
    where no other family defines it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SCHEMA = (
    "(Tensor! result, Tensor input, Tensor scale, SymInt[]? group_shape=None) -> ()"
)


def _static_scaled_fp8_quant(
    result: Any, input: Any, scale: Any, group_shape: Any = None
) -> None:
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    quant = QuantFP8(
        static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False
    )
    result.copy_(quant.forward_native(input, scale)[0])


@contextmanager
def stand_ins() -> Iterator[None]:
    """The op, defined as ``torch.ops._C.static_scaled_fp8_quant`` for the
    block (unless it exists)."""
    import torch

    if hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        yield
        return
    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define("static_scaled_fp8_quant" + SCHEMA)
        library.impl("static_scaled_fp8_quant", _static_scaled_fp8_quant, "CPU")
        yield
    finally:
        library._destroy()
