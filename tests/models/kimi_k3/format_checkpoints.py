"""Kimi-K3 checkpoints in each published format: header-only (no tensor
data), or small ones with seeded data.

Per format: the ``quantization_config`` vLLM builds the format's method from
(``kimi_k3_formats``) and every routed-expert tensor as that format's
published checkpoints store it, written out per projection: w1/w3 are
``[rows, cols] = [3072, hidden]`` and w2 ``[hidden, 3072]`` before packing,
grouping or blocking (the MXFP4 release's own layout: ``kimi_k3_checkpoint``).
The other configs of ``quantization_space`` store theirs as the format
registry says (``check``'s contract, held to the published ones here).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from tests.models.kimi_k3.kimi_k3_checkpoint import (
    HeaderEntry,
    KimiK3Spec,
    expert_tensor_name,
    other_tensors,
    split_into_shards,
    write_checkpoint,
    write_headers,
)
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.formats import recognise

Shape = Callable[[int, int], tuple[int, ...]]  # (rows, cols) -> stored shape

# suffix, stored shape, safetensors dtype
FORMAT_TENSORS: dict[str, list[tuple[str, Shape, str]]] = {
    "fp8-block": [
        ("weight", lambda rows, cols: (rows, cols), "F8_E4M3"),
        ("weight_scale", lambda rows, cols: (rows // 128, cols // 128), "BF16"),
    ],
    "nvfp4": [
        ("weight_packed", lambda rows, cols: (rows, cols // 2), "U8"),
        ("weight_scale", lambda rows, cols: (rows, cols // 16), "F8_E4M3"),
        ("weight_global_scale", lambda rows, cols: (1,), "F32"),
        ("input_global_scale", lambda rows, cols: (1,), "F32"),
    ],
    "modelopt-nvfp4": [
        ("weight", lambda rows, cols: (rows, cols // 2), "U8"),
        ("weight_scale", lambda rows, cols: (rows, cols // 16), "F8_E4M3"),
        ("weight_scale_2", lambda rows, cols: (), "F32"),
        ("input_scale", lambda rows, cols: (), "F32"),
    ],
    "w4a16": [
        ("weight_packed", lambda rows, cols: (rows, cols // 8), "I32"),
        ("weight_scale", lambda rows, cols: (rows, cols // 32), "BF16"),
        ("weight_shape", lambda rows, cols: (2,), "I64"),
    ],
    # AutoAWQ and AutoGPTQ: input-first, groups of 128, packed eight per int32
    # along the output (AWQ) or the input (GPTQ); zero points along the output
    "awq": [
        ("qweight", lambda rows, cols: (cols, rows // 8), "I32"),
        ("qzeros", lambda rows, cols: (cols // 128, rows // 8), "I32"),
        ("scales", lambda rows, cols: (cols // 128, rows), "BF16"),
    ],
    "gptq": [
        ("qweight", lambda rows, cols: (cols // 8, rows), "I32"),
        ("qzeros", lambda rows, cols: (cols // 128, rows // 8), "I32"),
        ("scales", lambda rows, cols: (cols // 128, rows), "BF16"),
    ],
    "bf16": [("weight", lambda rows, cols: (rows, cols), "BF16")],
}


# MXFP4 (native and compressed-tensors): FP4 packed two per byte along the
# input, one E8M0 scale byte per 32 values.
MXFP4_TENSORS = [
    ("weight_packed", lambda rows, cols: (rows, cols // 2), "U8"),
    ("weight_scale", lambda rows, cols: (rows, cols // 32), "U8"),
]


def tensors_of(fmt: str) -> list[tuple[str, Shape, str]]:
    """``fmt``'s expert tensors: the published layouts above, else (another
    config of the quantization space) as the format registry states them."""
    if fmt in FORMAT_TENSORS:
        return FORMAT_TENSORS[fmt]
    if fmt in ("mxfp4", "ct-mxfp4"):
        return MXFP4_TENSORS
    tensors = recognise(QUANTIZATION_CONFIGS[fmt], None, fmt).tensors
    # a [rows, cols] projection is stored as w1's [intermediate, hidden]
    return [
        (t.suffix, lambda rows, cols, t=t: t.shape("w1", cols, rows), t.dtypes[0])
        for t in tensors.sharded
    ] + [
        (s.suffix, lambda rows, cols, s=s: s.shape, s.dtypes[0])
        for s in tensors.scalars
    ]


def expert_entries(spec: KimiK3Spec, fmt: str) -> list[HeaderEntry]:
    entries = []
    hidden, intermediate = spec.routed_expert_hidden_size, spec.moe_intermediate_size
    for layer in spec.moe_layers:
        for expert in range(spec.num_experts):
            for projection in ("w1", "w3", "w2"):
                rows, cols = (
                    (hidden, intermediate)
                    if projection == "w2"
                    else (intermediate, hidden)
                )
                for suffix, shape, dtype in tensors_of(fmt):
                    name = expert_tensor_name(layer, expert, projection, suffix)
                    entries.append((name, dtype, shape(rows, cols)))
    return entries


def write_format_checkpoint(
    directory: Path,
    fmt: str,
    spec: KimiK3Spec | None = None,
    edit: Callable[[list[HeaderEntry]], None] | None = None,
) -> int:
    """Write a header-only checkpoint of ``fmt``; ``edit`` may change its
    entries first. Returns the number of routed-expert tensors written."""
    spec = spec or KimiK3Spec()
    experts = expert_entries(spec, fmt)
    entries = experts + [
        (name, "BF16", shape) for name, shape in other_tensors(spec).items()
    ]
    if edit is not None:
        edit(entries)
    config = spec.config()
    config["quantization_config"] = QUANTIZATION_CONFIGS[fmt]
    write_headers(directory, spec, entries, config)
    return len(experts)


# safetensors dtype -> torch dtype, for checkpoints with data
TORCH_DTYPES = {
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F16": torch.float16,
    "I32": torch.int32,
    "I64": torch.int64,
}


def tensor_data(
    spec: KimiK3Spec, name: str, dtype: str, shape: tuple[int, ...], seed: int
) -> Tensor:
    """Seeded, finite, non-zero values (a stored shape holds the real one)."""
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = TORCH_DTYPES[dtype]
    if name.endswith("weight_shape"):
        hidden, intermediate = (
            spec.routed_expert_hidden_size,
            spec.moe_intermediate_size,
        )
        rows_cols = (hidden, intermediate) if ".w2." in name else (intermediate, hidden)
        return torch.tensor(rows_cols, dtype=torch_dtype)
    if torch_dtype.is_floating_point:
        values = torch.rand(shape, generator=generator) * 4 + 0.5  # 0.5 .. 4.5
        return values.to(torch_dtype)
    high = 255 if torch_dtype == torch.uint8 else 2**30
    return torch.randint(1, high, shape, generator=generator, dtype=torch_dtype)


def expert_checkpoint(spec: KimiK3Spec, fmt: str) -> dict[str, Tensor]:
    """Every routed-expert tensor of ``spec``'s MoE layers in ``fmt``, by
    checkpoint key, with seeded non-zero data."""
    return {
        name: tensor_data(spec, name, dtype, shape, seed)
        for seed, (name, dtype, shape) in enumerate(expert_entries(spec, fmt))
    }


def write_format_checkpoint_with_data(
    directory: Path, fmt: str, spec: KimiK3Spec
) -> dict[str, Tensor]:
    """A small ``fmt`` checkpoint with data (routed experts only); returns
    its tensors by name."""
    tensors = expert_checkpoint(spec, fmt)
    config = spec.config()
    config["quantization_config"] = QUANTIZATION_CONFIGS[fmt]
    write_checkpoint(directory, spec, split_into_shards(tensors, spec.shards), config)
    return tensors
