"""A synthetic checkpoint in any Kimi-K3 format: the harness's MoE layer's
routed experts, written as the format's checkpoints store them.

Every tensor is one of the format's checkpoint tensors, with the shape and
dtype its contract gives (``formats``: the contract ``check`` and the strict
loader hold real checkpoints to), so the same record that describes a
format describes its synthetic checkpoint. Values are seeded per tensor,
finite and never zero (a misplaced or unwritten element shows): weights
signed, scales positive and near 1 (MXFP4 scale bytes 2^-3 .. 2^0, so that
no dequantized product overflows FP32). Activation scales (NVFP4's input
scales) are calibrated as a quantizer calibrates them, on the inputs the
harness feeds the layer (``reference.moe_inputs``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_kimi_k3_moe.formats import CheckpointFormat
from vllm_kimi_k3_moe.formats.layouts import (
    SCALE,
    TORCH_DTYPE_NAMES,
    safetensors_dtype,
)
from vllm_kimi_k3_moe.formats.safetensors_headers import INDEX_FILE
from vllm_kimi_k3_moe.tools.selftest import dequantize, reference
from vllm_kimi_k3_moe.tools.selftest.checkpoint import expert_key
from vllm_kimi_k3_moe.tools.selftest.shape import MoeShape

if TYPE_CHECKING:
    from torch import Tensor

SHARD = "model-00001-of-00001.safetensors"
# E8M0 scale bytes (127 is 2^0): 2^-3 .. 2^0
MXFP4_SCALE_BYTES = (124, 128)
# NVFP4 activations: FP4's largest value times FP8 E4M3's, which the global
# scale maps a tensor's largest magnitude to.
NVFP4_ACTIVATION_RANGE = 6.0 * 448.0
# Checkpoint suffixes of activation scales, and whether the checkpoint
# stores the encode scale (range / amax: compressed-tensors) or its inverse.
INPUT_SCALES = {"input_global_scale": True, "input_scale": False}


def _value(suffix: str, dtype: str, shape: tuple[int, ...], seed: int) -> Tensor:
    import torch

    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    if dtype == "U8" and suffix == SCALE:  # MXFP4's E8M0 scale bytes
        return torch.randint(*MXFP4_SCALE_BYTES, shape, generator=generator).to(
            torch_dtype
        )
    if torch_dtype.is_floating_point:
        magnitude = torch.rand(shape, generator=generator) * 4 + 0.5  # 0.5 .. 4.5
        if suffix != "weight":  # a scale: positive
            return magnitude.to(torch_dtype)
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        return (magnitude * sign).to(torch_dtype)
    info = torch.iinfo(torch_dtype)
    low = 1 if torch_dtype == torch.uint8 else info.min
    return torch.randint(low, info.max, shape, generator=generator, dtype=torch_dtype)


def expert_tensors(fmt: CheckpointFormat, shape: MoeShape) -> dict[str, Tensor]:
    """Every routed-expert tensor of the layer, by checkpoint key."""
    import torch

    contracts = fmt.tensors.contracts(shape.width, shape.intermediate)
    tensors = {}
    seed = 0
    for expert in range(shape.experts):
        for (projection, suffix), contract in contracts.items():
            rows, cols = (
                (shape.width, shape.intermediate)
                if projection == "w2"
                else (shape.intermediate, shape.width)
            )
            if suffix == "weight_shape":  # INT4's record of the logical shape
                value = torch.tensor([rows, cols], dtype=torch.int64)
            else:
                value = _value(suffix, contract.dtypes[0], contract.shape, seed)
            tensors[expert_key(expert, projection, suffix)] = value
            seed += 1
    return tensors


def _calibrate_input_scales(
    fmt: CheckpointFormat, shape: MoeShape, tensors: dict[str, Tensor]
) -> None:
    """Set each activation scale from the largest activation the layer sees:
    the hidden states for w1/w3, SiTU's output (of expert 0, every token)
    for w2."""
    import torch

    suffixes = [s for s in INPUT_SCALES if s in fmt.tensors.suffixes]
    if not suffixes:
        return
    w13, _ = dequantize.one_expert(fmt.format.name, tensors, torch.device("cpu"))(0)
    inputs = reference.moe_inputs(w13, shape, torch.device("cpu"))
    gate, up = (inputs.hidden.double() @ w13.double().T).split(
        shape.intermediate, dim=-1
    )
    largest = {
        "w1": inputs.hidden.abs().max(),
        "w3": inputs.hidden.abs().max(),
        "w2": reference.situ(gate, up).abs().max().float(),
    }
    for key, tensor in tensors.items():
        for suffix in suffixes:
            if key.endswith(f".{suffix}"):
                projection = key.split(".")[-2]
                encode = NVFP4_ACTIVATION_RANGE / largest[projection]
                value = encode if INPUT_SCALES[suffix] else 1 / encode
                tensor.fill_(float(value))


def _save(tensors: dict[str, Tensor], path: Path) -> None:
    """One safetensors shard: an 8-byte little-endian header length, the
    JSON header (dtype, shape, data offsets), the tensors' bytes. Written
    here, not by ``safetensors.torch``, whose import is torch's; read back
    by safetensors itself (``checkpoint.read_experts``)."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = []
    offset = 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": safetensors_dtype(str(tensor.dtype)),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    with path.open("wb") as shard:
        shard.write(struct.pack("<Q", len(text)) + text)
        shard.writelines(data)


def write_synthetic_checkpoint(
    directory: Path, fmt: CheckpointFormat, shape: MoeShape
) -> dict[str, Tensor]:
    """Write the layer's experts in ``fmt`` to ``directory`` (one shard and
    its index, next to the ``config.json`` the layer is built from); return
    them."""
    tensors = expert_tensors(fmt, shape)
    _calibrate_input_scales(fmt, shape, tensors)
    directory.mkdir(parents=True, exist_ok=True)
    _save(tensors, directory / SHARD)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": dict.fromkeys(tensors, SHARD),
    }
    (directory / INDEX_FILE).write_text(json.dumps(index))
    return tensors
