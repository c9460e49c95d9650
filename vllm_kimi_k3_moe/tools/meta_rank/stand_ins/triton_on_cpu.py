"""Stands in for what vLLM's Triton MoE path (``TritonExperts``, run by
Triton's interpreter on a CPU) calls besides Triton: the compiled ops of
``vllm._C`` and ``vllm._moe_C`` (block alignment, top-k sum, SiTU, per-token
FP8 quantization), the GPU's name for the tuned launch configs, and the
interpreter's narrowing float casts.

Why: a CUDA wheel on a CPU box does not load those ops, a CPU platform has
no GPU name, and the interpreter's casts lose a carry a GPU's ``cvt.rn``
keeps. What the real ones guarantee and each CPU kernel reproduces is said
at each one (vLLM's own Python where it has it); an op that exists is not
redefined.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.moe_forward import (
    situ_and_mul_op_on_cpu,
)

# The GPU whose tuned Triton MoE configs the interpreted kernel is launched
# with (vLLM's file-name form of ``torch.cuda.get_device_name``).
TRITON_CONFIG_GPU = "NVIDIA_H100_80GB_HBM3"


def _moe_align_block_size_on_cpu(
    topk_ids: Any,
    num_experts: int,
    block_size: int,
    sorted_token_ids: Any,
    expert_ids: Any,
    num_tokens_post_pad: Any,
    expert_map: Any = None,
    scatter_idx: Any = None,
) -> None:
    """``_moe_C::moe_align_block_size`` (csrc/moe/moe_align_sum_kernels.cu),
    as ``moe_align_block_size.moe_align_block_size`` documents it: the
    routed slots (``topk_ids`` flattened) grouped by expert in slot order,
    each expert's run padded with the sentinel ``topk_ids.numel()`` to a
    multiple of ``block_size``; one expert id per block; the padded total.
    Given ``expert_map`` (``ignore_invalid_experts``), slots of experts not
    on this rank are left out and blocks carry local ids. It computes
    indices, not values: the kernel reads the tokens it names."""
    import torch

    flat = topk_ids.flatten().long()
    sentinel = flat.numel()
    experts = flat if expert_map is None else expert_map.long()[flat]
    sorted_token_ids.fill_(sentinel)
    expert_ids.fill_(-1)
    position = block = 0
    for expert in range(num_experts if expert_map is None else int(experts.max()) + 1):
        slots = (experts == expert).nonzero().flatten()
        if slots.numel() == 0:
            continue
        padded = -(-slots.numel() // block_size) * block_size
        sorted_token_ids[position : position + slots.numel()] = slots.to(torch.int32)
        expert_ids[block : block + padded // block_size] = expert
        position, block = position + padded, block + padded // block_size
    num_tokens_post_pad.fill_(position)
    if scatter_idx is not None:
        scatter_idx.copy_(
            torch.where(experts >= 0, torch.arange(sentinel), -1)[:, None]
        )


def _moe_sum_on_cpu(
    input: Any, output: Any, topk_ids: Any = None, expert_map: Any = None
) -> None:
    """``_moe_C::moe_sum``: each token's top-k rows summed into ``output``;
    with ``expert_map``, the slots of experts not on this rank left out."""
    if expert_map is not None:
        held = (expert_map[topk_ids.long()] >= 0).to(input.dtype)[..., None]
        input = input * held
    output.copy_(input.sum(dim=1))


def _dynamic_per_token_scaled_fp8_quant_on_cpu(
    out: Any, input: Any, scale: Any, scale_ub: Any = None
) -> None:
    """``_C::dynamic_per_token_scaled_fp8_quant`` as vLLM's own
    ``QuantFP8.forward_native`` computes it for dynamic per-token scales."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    quant = QuantFP8(
        static=False, group_shape=GroupShape.PER_TOKEN, compile_native=False
    )
    values, scales = quant.forward_native(input, scale_ub=scale_ub)
    out.copy_(values)
    scale.copy_(scales)


# Triton's float types the interpreter's narrowing casts are redone for, as
# torch's dtype names (``_narrowing_float_cast``).
_TORCH_FLOATS = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8e4nv": "float8_e4m3fn",
    "fp8e5": "float8_e5m2",
}


def _narrowing_float_cast(own: Any) -> Any:
    """Triton's interpreter's ``_convert_float`` (a float cast in numpy, bit
    by bit), but narrowing casts rounded to nearest even as a GPU's
    ``cvt.rn`` rounds them, by torch's cast. The interpreter's own (Triton
    3.8) loses the carry when rounding up overflows the mantissa: FP32 7.9
    to FP8 e4m3 gives 4 (a GPU: 8), 127 gives 64, 31 gives 16; so vLLM's
    Triton activation quantization (``per_token_group_quant_fp8``),
    interpreted, would hand the MoE GEMM values off by half. Every other
    cast (widening, integers, round-toward-zero) stays the interpreter's."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    @functools.wraps(own)
    def convert(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any):
        source = _TORCH_FLOATS.get(input_dtype.name)
        target = _TORCH_FLOATS.get(output_dtype.name)
        narrowing = input_dtype.primitive_bitwidth > output_dtype.primitive_bitwidth
        nearest = rounding_mode in (None, interpreter._ir.ROUNDING_MODE.RTNE)
        if not (source and target and narrowing and nearest):
            return own(input, input_dtype, output_dtype, rounding_mode)
        values = torch.frombuffer(
            bytearray(input.tobytes()), dtype=getattr(torch, source)
        )
        bits = output_dtype.primitive_bitwidth
        cast = values.to(getattr(torch, target)).view(getattr(torch, f"int{bits}"))
        unsigned = getattr(np, f"uint{bits}")
        return cast.numpy().view(unsigned).reshape(input.shape)

    return convert


@contextmanager
def triton_moe_forward_on_cpu() -> Iterator[None]:
    """What vLLM's Triton MoE path (``TritonExperts``: ``fused_moe_kernel``
    and the Triton activation quantization, run by Triton's interpreter)
    calls besides Triton, from ``vllm._C`` / ``vllm._moe_C``, which a CUDA
    wheel on a CPU box does not load: the routed slots' alignment to the
    kernel's blocks, the top-k sum, the SiTU op (``situ_and_mul_op_on_cpu``)
    and per-token FP8 activation quantization. Each is defined for the
    block with a CPU kernel (vLLM's own Python where it has one:
    ``SituAndMul.forward_native``, ``QuantFP8.forward_native``) and removed
    again on exit; none is defined where the op exists. And the name of
    the GPU, by which the kernel's launch config (tile sizes) is looked up
    (``get_config_file_name``): an H100's (``TRITON_CONFIG_GPU``), where a
    CPU's platform has none. And, for the interpreter itself, its narrowing
    float casts rounded as a GPU rounds them (``_narrowing_float_cast``).
    Hold no parameters."""
    import torch
    from triton.runtime import interpreter
    from vllm.model_executor.layers.fused_moe import fused_moe

    with ExitStack() as stack:
        stack.enter_context(situ_and_mul_op_on_cpu())
        stack.enter_context(
            replaced_attributes(
                interpreter,
                _convert_float=_narrowing_float_cast(interpreter._convert_float),
            )
        )
        stack.enter_context(
            replaced_attributes(
                fused_moe, get_device_name_as_file_name=lambda: TRITON_CONFIG_GPU
            )
        )
        for namespace, name, schema, kernel in (
            (
                "_moe_C",
                "moe_align_block_size",
                "(Tensor topk_ids, int num_experts, int block_size, "
                "Tensor! sorted_token_ids, Tensor! experts_ids, "
                "Tensor! num_tokens_post_pad, Tensor? expert_map=None, "
                "Tensor!? scatter_idx=None) -> ()",
                _moe_align_block_size_on_cpu,
            ),
            (
                "_moe_C",
                "moe_sum",
                "(Tensor input, Tensor! output, Tensor? topk_ids=None, "
                "Tensor? expert_map=None) -> ()",
                _moe_sum_on_cpu,
            ),
            (
                "_C",
                "dynamic_per_token_scaled_fp8_quant",
                "(Tensor! result, Tensor input, Tensor! scale, "
                "Tensor? scale_ub=None) -> ()",
                _dynamic_per_token_scaled_fp8_quant_on_cpu,
            ),
        ):
            if hasattr(getattr(torch.ops, namespace), name):
                continue
            library = torch.library.Library(namespace, "FRAGMENT")
            stack.callback(library._destroy)
            library.define(name + schema)
            library.impl(name, kernel, "CPU")
        yield
