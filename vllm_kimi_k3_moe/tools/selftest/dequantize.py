"""Routed experts dequantized to FP32 with vLLM's own helpers: a rank's loaded
parameters (what the CPU reference kernel runs) and the checkpoint's tensors
(what the reference is computed from).

Each format's weights are unpacked and scaled by the helper vLLM uses for
that format's emulation or requantization: ``upcast_from_mxfp_torch``
(MXFP4), ``scaled_dequantize`` (FP8 blocks of 128), ``dequantize_nvfp4_moe_
weights`` (NVFP4, compressed-tensors and ModelOpt), ``_process_weights_
emulation_gptq`` (INT4 W4A16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_kimi_k3_moe.compat import dequantized_nvfp4_moe_weights
from vllm_kimi_k3_moe.tools.selftest.checkpoint import expert_key

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

Weights = tuple["Tensor", "Tensor"]  # w13 [E, 2n, H] (gate rows, then up), w2 [E, H, n]

# Per format, the layer parameters (``w13_{suffix}``, ``w2_{suffix}``) a
# rank's experts are computed from: the weight first, then its scales.
PARAMETER_SUFFIXES = {
    "mxfp4": ("weight", "weight_scale"),  # native MXFP4 renames weight_packed
    "ct-mxfp4": ("weight_packed", "weight_scale"),
    "fp8-block": ("weight", "weight_scale"),
    "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
    "modelopt-nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "w4a16": ("weight_packed", "weight_scale"),
    "bf16": ("weight",),
}
# The formats with a CPU path: all of the published ones. What has none is
# each format's GPU kernel (Marlin, CUTLASS, FlashInfer, DeepGEMM, ...).
FORMATS = tuple(PARAMETER_SUFFIXES)


def _mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    import torch
    from vllm.third_party.triton_kernels.numerics_details.mxfp import (
        upcast_from_mxfp_torch,
    )

    return upcast_from_mxfp_torch(packed, scale, torch.float32, axis=-1)


def _fp8_block(weight: Tensor, scale: Tensor) -> Tensor:
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
    )

    return scaled_dequantize(weight, scale, GroupShape(128, 128), torch.float32)


def _nvfp4(*tensors: Tensor, ct: bool) -> Weights:
    """``tensors``: w13's packed weight, block scales and global scales, then
    w2's."""
    import torch

    # compressed-tensors stores the global encode scale, ModelOpt its inverse
    return dequantized_nvfp4_moe_weights(
        *tensors, torch.float32, invert_global_scales=ct
    )


def _w4a16(w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor) -> Weights:
    # What vLLM's W4A16 emulation backend does to a compressed-tensors
    # checkpoint's N-first weights: unpack the int4 (offset 8) and scale them.
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
        _process_weights_emulation_gptq,
    )

    dequantized = _process_weights_emulation_gptq(
        w13, w2, w13_scale, w2_scale, None, None
    )
    return dequantized[0].float(), dequantized[1].float()


def dequantize(fmt: str, tensors: dict[str, Tensor]) -> Weights:
    """FP32 ``w13``/``w2`` from ``fmt``'s parameters, with vLLM's helpers."""
    w13, w2 = (
        [tensors[f"{prefix}_{suffix}"] for suffix in PARAMETER_SUFFIXES[fmt]]
        for prefix in ("w13", "w2")
    )
    if fmt == "bf16":
        return w13[0].float(), w2[0].float()
    if fmt in ("mxfp4", "ct-mxfp4"):
        return _mxfp4(*w13), _mxfp4(*w2)
    if fmt == "fp8-block":
        return _fp8_block(*w13), _fp8_block(*w2)
    if fmt in ("nvfp4", "modelopt-nvfp4"):
        return _nvfp4(*w13, *w2, ct=fmt == "nvfp4")
    if fmt == "w4a16":
        return _w4a16(w13[0], w2[0], w13[1], w2[1])
    raise ValueError(f"no CPU path for {fmt!r}")


def rank_weights(fmt: str, experts: nn.Module) -> Weights:
    """A rank's loaded routed experts (``RoutedExperts``), pads included,
    dequantized to FP32, one expert at a time into the result: vLLM's
    dequantizers make temporaries several times the size of what they are
    given (MXFP4's ~16 bytes per packed byte), which for a whole layer at
    the real width (``selftest --checkpoint``) would be gigabytes."""
    import torch

    tensors = {n: p.data for n, p in experts.named_parameters()}
    count = experts.local_num_experts
    w13 = w2 = None
    for expert in range(count):
        one = {
            name: tensor[expert : expert + 1]
            if tensor.dim() and tensor.shape[0] == count
            else tensor
            for name, tensor in tensors.items()
        }
        expert_w13, expert_w2 = dequantize(fmt, one)
        if w13 is None or w2 is None:
            w13 = torch.empty((count, *expert_w13.shape[1:]), dtype=torch.float32)
            w2 = torch.empty((count, *expert_w2.shape[1:]), dtype=torch.float32)
        w13[expert : expert + 1] = expert_w13
        w2[expert : expert + 1] = expert_w2
    assert w13 is not None and w2 is not None
    return w13, w2


def checkpoint_weights(
    fmt: str, tensors: dict[str, Tensor], experts: range | list[int]
) -> Weights:
    """``experts`` unsharded, dequantized to FP32 from the checkpoint's tensors
    alone (``checkpoint.read_experts``): each expert's w1 rows, then its w3
    rows, as ``w13``; a per-tensor value of w1 next to w3's."""
    import torch

    parameters = {}
    for suffix in PARAMETER_SUFFIXES[fmt]:
        stored = "weight_packed" if (fmt, suffix) == ("mxfp4", "weight") else suffix

        def of(expert: int, projection: str, stored: str = stored) -> Tensor:
            return tensors[expert_key(expert, projection, stored)]

        if of(experts[0], "w1").dim() == 2:  # a matrix, split over the ranks
            w13 = [torch.cat([of(e, "w1"), of(e, "w3")]) for e in experts]
            w2 = [of(e, "w2") for e in experts]
        else:  # a per-tensor value
            w13 = [
                torch.cat([of(e, p).reshape(1) for p in ("w1", "w3")]) for e in experts
            ]
            w2 = [of(e, "w2").reshape(()) for e in experts]
        parameters[f"w13_{suffix}"] = torch.stack(w13)
        parameters[f"w2_{suffix}"] = torch.stack(w2)
    return dequantize(fmt, parameters)


def one_expert(
    fmt: str, tensors: dict[str, Tensor], device: torch.device
) -> Callable[[int], Weights]:
    """``expert -> (w13, w2)`` of that expert alone, FP32 on ``device``."""

    def weights(expert: int) -> Weights:
        w13, w2 = checkpoint_weights(fmt, tensors, [expert])
        return w13[0].to(device), w2[0].to(device)

    return weights
