"""The GPU quantizers of vLLM's online MoE methods, as torch that computes the
same format.

Why here, shared: an online method (``--quantization fp8_per_block``, ...)
gets its partition rule from what its own ``process_weights_after_loading``
quantizes to (``model_executor.layers.fused_moe.online.quantized_rule``),
and that calls these ops, which a CPU box lacks (vLLM's CUDA wheel loads no
``vllm._C`` there; Triton does not run). ``plan`` builds the model on
``meta`` with them (``whole_model.build_rank``), and the test suite
quantizes real CPU tensors with them (``tests/models/kimi_k3/preparation``),
so both learn the rule as a serving GPU does. Only the ops are stood in;
the methods, their scale and block shapes and what they hand their kernel
are vLLM's own code. A ``_C`` op's kernel on ``meta`` writes nothing: it
only fills output tensors vLLM's Python allocated, whose shapes and dtypes
are all a ``meta`` tensor has (as torch's own meta kernels of ``out=``
ops).

Each computes new values (none is a rearrangement): the tests hold what the
method quantized to the BF16 it loaded within the format's error, and its
pads to zero, never to a stand-in's formula.

``mxfp4_utils.downcast_to_mxfp`` (``mxfp4_quantize``: online MXFP4)
    vLLM's Triton kernel ``_downcast_to_mxfp``: per group of 32 values along
    the last axis an E8M0 scale from the group's largest magnitude, the values
    rounded to E2M1 and packed two per byte (low nibble first). Triton does
    not run on a CPU. The stand-in is the torch reference triton_kernels ships
    of the same conversion (``numerics_details.mxfp.downcast_to_mxfp_torch``),
    in vLLM's tree; it rounds the scale up where vLLM's kernel rounds it to
    nearest even (OCP MX), so a value may land one E2M1 step apart. On
    ``meta``, answered once per input (``_on_meta``).
``deep_gemm.per_block_cast_to_fp8`` (online FP8 per block's quantizer, as
``online/fp8.py`` imports it; on ``meta`` only)
    Not stood in for a missing op: vLLM compiles it with ``torch.compile``,
    which on ``meta`` traces it anew per shape (20 s a plan here). On
    ``meta`` its own Python answers, once per input (``_on_meta``); on any
    other device it is vLLM's own, compiled.

On ``meta`` (``plan``) each of these two is answered once per input shape,
stride and dtype (and arguments): a ``meta`` tensor holds no values, so the
shapes, strides and dtypes the function's Python gives for such an input
are all there is, handed back as new ``meta`` tensors each call. vLLM's
online methods quantize a rank's experts one by one (896 alike at TP32,
twice a layer, each a few milliseconds of torch's meta kernels).
``_C::scaled_fp4_quant.out`` (``ops.scaled_fp4_quant``: online NVFP4)
    csrc: per group of 16 values an FP8 (E4M3) scale of the group's largest
    magnitude over 6, times the tensor's global scale, the values divided by
    it and rounded to E2M1, packed two per byte (low nibble first); scales
    unswizzled, as the online method asks. The stand-in is vLLM's own torch
    reference of it (``nvfp4_emulation_utils.ref_nvfp4_quant``), packed.
``_C::static_scaled_fp8_quant`` (``ops.scaled_fp8_quant`` with a scale:
online FP8 per tensor, and FP8 per tensor's requantization of w1 and w3 with
the larger of their scales)
    csrc/quantization/w8a8/fp8/common.cu: each value times 1 / scale,
    clamped to float8_e4m3fn's range, rounded to it. The stand-in is vLLM's
    ``QuantFP8.forward_native`` for a static per-tensor scale, the same
    arithmetic in torch.
``_C::dynamic_per_token_scaled_fp8_quant`` (``ops.scaled_fp8_quant`` without
a scale, per token: online FP8 per channel's w13)
    csrc: one scale per row (its largest magnitude over FP8's), the row
    divided by it, rounded to float8_e4m3fn. The stand-in is vLLM's
    ``QuantFP8.forward_native`` for dynamic per-token scales, the same
    arithmetic in torch.
Each is defined only for the block (and only where the op is missing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes

FP4_SCHEMA = (
    "scaled_fp4_quant.out(Tensor input, Tensor input_scale, "
    "bool is_sf_swizzled_layout, *, Tensor(a!) output, Tensor(b!) output_scale) "
    "-> ()"
)
STATIC_FP8_SCHEMA = (
    "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
    "SymInt[]? group_shape=None) -> ()"
)
PER_TOKEN_FP8_SCHEMA = (
    "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, "
    "Tensor! scale, Tensor? scale_ub) -> ()"
)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7


def _downcast_to_mxfp(
    src_tensor: Any, axis: int, *args: Any, **kwargs: Any
) -> tuple[Any, Any, tuple[int, ...]]:
    import torch
    from vllm.third_party.triton_kernels.numerics_details.mxfp import (
        downcast_to_mxfp_torch,
    )

    assert not args and not kwargs, "only mxfp4_quantize's call is stood in"
    if src_tensor.device.type == "meta":
        quant, scale = _on_meta(downcast_to_mxfp_torch, src_tensor, torch.uint8, axis)
    else:
        quant, scale = downcast_to_mxfp_torch(src_tensor, torch.uint8, axis)
    return quant, scale, tuple(scale.shape)


def _per_block_cast_to_fp8(compiled: Any) -> Any:
    """vLLM's compiled ``per_block_cast_to_fp8``, its Python on ``meta``."""

    def per_block_cast_to_fp8(x: Any, *args: Any, **kwargs: Any) -> Any:
        if x.device.type != "meta":
            return compiled(x, *args, **kwargs)
        from vllm.platforms import current_platform

        # its FP8 dtype is the platform's (ROCm's CDNA3: float8_e4m3fnuz)
        return _on_meta(
            compiled.__wrapped__, x, *args, **kwargs, _key=current_platform.fp8_dtype()
        )

    per_block_cast_to_fp8.__wrapped__ = compiled.__wrapped__  # entered again
    return per_block_cast_to_fp8


_META_ANSWERS: dict[tuple[Any, ...], tuple[tuple[Any, ...], ...]] = {}


def _described(value: Any) -> Any:
    """What of an argument a function's ``meta`` outputs can depend on."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_described, value))
    return value


def _on_meta(python: Any, *args: Any, _key: Any = None, **kwargs: Any) -> tuple:
    """New ``meta`` tensors shaped as ``python(*args, **kwargs)`` gives them,
    ``python`` run once per description of its arguments (and ``_key``)."""
    import torch

    key = (python, _key, _described(args), _described(sorted(kwargs.items())))
    if key not in _META_ANSWERS:
        _META_ANSWERS[key] = tuple(
            (tuple(t.shape), t.stride(), t.dtype) for t in python(*args, **kwargs)
        )
    return tuple(
        torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        for shape, stride, dtype in _META_ANSWERS[key]
    )


def _e2m1_codes(values: Any) -> Any:
    """E2M1 values (``cast_to_fp4``'s) to their 4-bit codes."""
    import torch

    magnitudes = torch.tensor(E2M1, dtype=values.dtype)
    codes = (values.abs().unsqueeze(-1) == magnitudes).to(torch.uint8).argmax(-1)
    return codes.to(torch.uint8) | ((values < 0).to(torch.uint8) << 3)


def _scaled_fp4_quant(
    input: Any,
    input_scale: Any,
    is_sf_swizzled_layout: bool,
    *,
    output: Any,
    output_scale: Any,
) -> None:
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant,
    )

    assert not is_sf_swizzled_layout, "online NVFP4 asks for linear scales"
    values, scales = ref_nvfp4_quant(input, input_scale.float(), 16)
    codes = _e2m1_codes(values).reshape(input.shape[0], -1, 2)
    output.copy_(codes[..., 0] | (codes[..., 1] << 4))
    output_scale.copy_(scales.to(torch.float8_e4m3fn).view(torch.uint8))


def _dynamic_per_token_scaled_fp8_quant(
    result: Any, input: Any, scale: Any, scale_ub: Any = None
) -> None:
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    assert scale_ub is None, "online FP8 per channel gives no upper bound"
    quant = QuantFP8(
        static=False, group_shape=GroupShape.PER_TOKEN, compile_native=False
    )
    values, scales = quant.forward_native(input)
    result.copy_(values)
    scale.copy_(scales)


def _static_scaled_fp8_quant(
    result: Any, input: Any, scale: Any, group_shape: Any = None
) -> None:
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    quant = QuantFP8(
        static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False
    )
    result.copy_(quant.forward_native(input, scale)[0])


def _writes_into_its_outputs(*args: Any, **kwargs: Any) -> None:
    """The ops' kernel on ``meta``: each writes only into output tensors its
    caller (vLLM's Python) allocated, whose shapes and dtypes are all a
    ``meta`` tensor holds; so, like torch's own meta kernels of ``out=`` ops,
    it computes nothing."""


@contextmanager
def _op(name: str, schema: str, kernel: Any) -> Iterator[None]:
    import torch

    if hasattr(torch.ops._C, name.split(".")[0]):
        yield
        return
    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define(schema)
        library.impl(name, kernel, "CPU")
        library.impl(name, _writes_into_its_outputs, "Meta")
        yield
    finally:
        library._destroy()


@contextmanager
def online_method_quantizers() -> Iterator[None]:
    """Every quantizer above, for the block (an op vLLM has is left as is)."""
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8
    from vllm.model_executor.layers.quantization.utils import mxfp4_utils

    compiled = online_fp8.per_block_cast_to_fp8
    with ExitStack() as stack:
        stack.enter_context(
            replaced_attributes(mxfp4_utils, downcast_to_mxfp=_downcast_to_mxfp)
        )
        stack.enter_context(
            replaced_attributes(
                online_fp8, per_block_cast_to_fp8=_per_block_cast_to_fp8(compiled)
            )
        )
        stack.enter_context(_op("scaled_fp4_quant.out", FP4_SCHEMA, _scaled_fp4_quant))
        stack.enter_context(
            _op("static_scaled_fp8_quant", STATIC_FP8_SCHEMA, _static_scaled_fp8_quant)
        )
        stack.enter_context(
            _op(
                "dynamic_per_token_scaled_fp8_quant",
                PER_TOKEN_FP8_SCHEMA,
                _dynamic_per_token_scaled_fp8_quant,
            )
        )
        yield


# the name each family of the test suite's stand-ins enters them by
stand_ins = online_method_quantizers
