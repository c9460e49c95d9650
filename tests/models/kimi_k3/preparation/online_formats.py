"""How each online method's quantized experts dequantize (with vLLM's own
helpers where it has one), the error each format allows, and what makes a
GPU's quantized experts right: every row it holds within the format's error
of the BF16 it loaded, every pad row exactly zero.

The tolerances are the formats' worst rounding, relative to the held rows'
root mean square (the synthetic BF16 weights are 0.5 to 4.5 in magnitude,
so every value is a normal number of each format): a scale taken from
memory nobody wrote (NaN, or 0x7f bytes: 3.4e38) gives NaN or an error near
1, as a 128-row FP8 block spanning unwritten pad rows does (0.58 at TP16).
"""

from __future__ import annotations

from typing import Any

# Relative error (root mean square over the held rows) each format allows:
# FP8 E4M3 rounds to 3 mantissa bits (at most 2^-4 of a value); INT8 per row
# to amax / 127 (at most 1 / 254 of the row's largest value: under 2^-6 of
# these values' spread); E2M1 (MXFP4, NVFP4) to its steps 0.5, 1, 1.5, 2, 3,
# 4, 6 of the group's scale (up to 1/5 of a value); LUT-B to one of eight
# codebook entries per 8 x 64 tile.
TOLERANCE = {
    "fp8-block": 2**-4,
    "fp8-tensor": 2**-4,
    "fp8-channel": 2**-4,
    "mxfp8": 2**-4,
    "int8": 2**-6,
    "mxfp4": 0.2,
    "nvfp4": 0.2,
    "lut-b": 0.25,
}


def _scaled(values: Any, scale: Any) -> Any:
    """``values`` (float8 or int8, ``[E, N, K]``) times a scale per tensor
    (``[E]``), per row (``[E, N]``, ``[E, N, 1]``) or per block (``[E, N /
    bn, K / bk]``), broadcast as vLLM broadcasts group scales."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        group_broadcast,
    )

    scale = scale.float()
    while scale.dim() < values.dim():
        scale = scale.unsqueeze(-1)
    return values.float() * group_broadcast(scale, values.shape)


def _mxfp4(packed: Any, scale: Any) -> Any:
    import torch
    from vllm.third_party.triton_kernels.numerics_details.mxfp import (
        upcast_from_mxfp_torch,
    )

    return upcast_from_mxfp_torch(packed, scale, torch.float32, axis=-1)


def _mxfp8(values: Any, scale: Any) -> Any:
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        dequant_mxfp8_to_bf16,
    )

    return dequant_mxfp8_to_bf16(values, scale).float()


def _nvfp4(packed: Any, scale: Any, scale_2: Any) -> Any:
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    return dequantize_to_dtype(
        packed, scale.view(torch.uint8), scale_2, torch.float32, swizzle=False
    )


def dequantized(fmt: str, tensors: dict[str, Any], experts: Any) -> tuple[Any, Any]:
    """w13 and w2 as the method quantized them (``Quantized.tensors``), in
    FP32; LUT-B's emulation leaves its weights dequantized on the layer."""
    if fmt == "lut-b":
        return experts.w13_weight.float(), experts.w2_weight.float()
    out = []
    for name in ("w13", "w2"):
        values, scale = tensors[name], tensors[f"{name}_scale"]
        if fmt == "mxfp4":
            out.append(_mxfp4(values, scale))
        elif fmt == "mxfp8":
            out.append(_mxfp8(values, scale))
        elif fmt == "nvfp4":
            out.append(_nvfp4(values, scale, tensors[f"{name}_scale_2"]))
        else:
            out.append(_scaled(values, scale))
    return out[0], out[1]


def held_and_pads(w13: Any, w2: Any, held: int) -> tuple[list[Any], list[Any]]:
    """The rows a GPU holds (gate, up, down) and its pad rows past them,
    of tensors ``[E, 2 x allocated, K]`` and ``[E, K, allocated]``."""
    allocated = w2.shape[-1]
    gate, up = w13[:, :allocated], w13[:, allocated:]
    return (
        [gate[:, :held], up[:, :held], w2[..., :held]],
        [gate[:, held:], up[:, held:], w2[..., held:]],
    )


def relative_error(got: Any, expected: Any) -> float:
    expected = expected.float()
    return float((got - expected).norm() / expected.norm())


def quantization_problems(
    fmt: str, tensors: dict[str, Any], experts: Any, loaded: tuple[Any, Any]
) -> list[str]:
    """What is wrong with a GPU's quantized experts: a held row beyond the
    format's error of the BF16 loaded (``loaded``: w13, w2 of the held
    rows), a pad row not zero."""
    import torch

    w13, w2 = dequantized(fmt, tensors, experts)
    held = loaded[1].shape[-1]
    rows, pads = held_and_pads(w13, w2, held)
    expected = (loaded[0][:, :held], loaded[0][:, held:], loaded[1])
    found = []
    for name, got, want in zip(("gate", "up", "down"), rows, expected, strict=True):
        error = relative_error(got, want)
        if not error <= TOLERANCE[fmt]:  # NaN too
            found.append(f"{name} rows off by {error:.3g} (allowed {TOLERANCE[fmt]})")
    for name, pad in zip(("gate", "up", "down"), pads, strict=True):
        if pad.numel() and not bool((pad == 0).all()):
            bad = pad[pad != 0]
            found.append(
                f"{name} pad ({pad.shape[-1 if name == 'down' else 1]} rows) "
                f"dequantizes to {bad.flatten()[0].item():.3g} "
                f"({'non-finite' if not torch.isfinite(bad).all() else 'finite'})"
            )
    return found
