"""Which published format a Kimi-K3 checkpoint is in, from its config alone.

Plain Python (no torch, no vLLM): ``check`` reads ``config.json``'s
``quantization_config`` (or ModelOpt's ``hf_quant_config.json``) and gets the
format's routed-expert layout (``expert_tensor_layouts``) the way vLLM 0.33.0
will pick the experts' quantization method.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_kimi_k3_moe.formats import layouts
from vllm_kimi_k3_moe.formats.layouts import CheckpointFormat, ExpertScalar

# A routed expert's module name as compressed-tensors matches its targets.
EXPERT_MODULE = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"

KNOWN_FORMATS = (
    "compressed-tensors mxfp4-pack-quantized (the release), other "
    "compressed-tensors MXFP4, compressed-tensors FP8 block (float-quantized), "
    "compressed-tensors nvfp4-pack-quantized, ModelOpt NVFP4, compressed-tensors "
    "pack-quantized INT4 W4A16, BF16 (no quantization_config)"
)


class FormatError(ValueError):
    """A quantization config no known Kimi-K3 format matches; one line."""


def _refuse(where: str, found: str) -> FormatError:
    return FormatError(f"{where}: {found}; check knows {KNOWN_FORMATS}")


def _expert_weights(config: dict[str, Any]) -> dict[str, Any] | None:
    """The weight scheme of the compressed-tensors group that targets the
    routed experts (``Linear``, or a ``re:`` pattern matching them)."""
    groups = config.get("config_groups")
    for group in groups.values() if isinstance(groups, dict) else ():
        if not isinstance(group, dict):
            continue
        for target in group.get("targets") or ():
            pattern = str(target)
            if pattern == "Linear" or (
                pattern.startswith("re:") and re.match(pattern[3:], EXPERT_MODULE)
            ):
                weights = group.get("weights")
                return weights if isinstance(weights, dict) else None
    return None


def _compressed_tensors(config: dict[str, Any], where: str) -> CheckpointFormat:
    fmt = config.get("format")
    if fmt == "mxfp4-pack-quantized":
        return CheckpointFormat(
            "compressed-tensors mxfp4-pack-quantized",
            "native MXFP4 (Mxfp4MoEMethod)",
            layouts.mxfp4(),
            plan_path="mxfp4",
        )
    weights = _expert_weights(config)
    if weights is None:
        raise _refuse(where, f"no compressed-tensors group targets the experts ({fmt})")
    bits, kind = weights.get("num_bits"), weights.get("type")
    strategy, group = weights.get("strategy"), weights.get("group_size")
    if fmt == "nvfp4-pack-quantized":
        return CheckpointFormat(
            "compressed-tensors nvfp4-pack-quantized",
            "CompressedTensorsW4A4Nvfp4MoEMethod",
            layouts.nvfp4("weight_packed"),
            (
                ExpertScalar("weight_global_scale", (1,), ("F32",)),
                ExpertScalar("input_global_scale", (1,), ("F32",)),
            ),
        )
    if (bits, kind, group) == (4, "float", 32):
        return CheckpointFormat(
            f"compressed-tensors {fmt} MXFP4",
            "CompressedTensorsW4A4Mxfp4MoEMethod",
            layouts.mxfp4(),
            plan_path="compressed-tensors",
        )
    if (bits, kind, strategy) == (8, "float", "block"):
        block_out, block_in = weights.get("block_structure") or (128, 128)
        return CheckpointFormat(
            f"compressed-tensors FP8 block [{block_out}, {block_in}]",
            "CompressedTensorsW8A8Fp8MoEMethod",
            layouts.fp8_block(block_out, block_in),
        )
    if kind == "int" and strategy == "group" and bits in (4, 8) and group:
        return CheckpointFormat(
            f"compressed-tensors INT{bits} W{bits}A16, groups of {group}",
            "CompressedTensorsWNA16MoEMethod",
            layouts.int_packed(bits, group),
            (ExpertScalar("weight_shape", (2,), ("I64", "I32")),),
        )
    raise _refuse(
        where,
        f"compressed-tensors {fmt} with {bits}-bit {kind} {strategy} weights",
    )


def _modelopt_nvfp4() -> CheckpointFormat:
    return CheckpointFormat(
        "ModelOpt NVFP4",
        "ModelOptNvFp4FusedMoE",
        layouts.nvfp4("weight"),
        (
            ExpertScalar("weight_scale_2", (), ("F32",)),
            ExpertScalar("input_scale", (), ("F32",)),
        ),
    )


def checkpoint_format(
    quantization_config: Any, hf_quant_config: Any, where: str
) -> CheckpointFormat:
    """The format ``config.json``'s ``quantization_config`` (or ModelOpt's
    ``hf_quant_config.json``) describes; ``where`` names the file in errors."""
    if isinstance(hf_quant_config, dict):
        algo = (hf_quant_config.get("quantization") or {}).get("quant_algo")
        if algo == "NVFP4":
            return _modelopt_nvfp4()
        raise _refuse(f"{where} (hf_quant_config.json)", f"quant_algo {algo!r}")
    if quantization_config is None:
        return CheckpointFormat(
            "BF16 (no quantization_config)",
            "UnquantizedFusedMoEMethod",
            layouts.unquantized(),
        )
    if not isinstance(quantization_config, dict):
        raise _refuse(where, "quantization_config is not an object")
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config, where)
    if method == "modelopt":
        algo = quantization_config.get("quant_algo")
        if algo == "NVFP4":
            return _modelopt_nvfp4()
        raise _refuse(where, f"ModelOpt quant_algo {algo!r}")
    raise _refuse(where, f"quantization_config.quant_method {method!r}")
