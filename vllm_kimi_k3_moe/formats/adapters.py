"""Kimi-K3's latent adapters: whether a config quantizes them, and their tensors.

Each MoE layer projects the residual (``hidden_size``, 7168) down to the
experts' width (``routed_expert_hidden_size``, 3584) and back up:
``routed_expert_down_proj`` and ``routed_expert_up_proj``, two
``ReplicatedLinear`` layers vLLM (0.33.0 on, PR 57430) builds with the
checkpoint's quantization config, so that they are quantized unless the
config leaves them out: every GPU holds both whole, 51.4 M parameters per
layer. ``adapters_quantized`` says, from the config files alone, what vLLM's
config decides for them (``tests/upstream_contract`` holds it to vLLM's
``get_quant_method``); a quantized adapter is stored as the format stores an
expert's down projection, ``[output, input]`` before packing, so its
tensors are held to the experts' contracts.

Plain Python: no torch, no vLLM.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from vllm_kimi_k3_moe.formats.layouts import ExpertTensors, TensorContract

ADAPTERS = ("routed_expert_down_proj", "routed_expert_up_proj")
# An adapter's module name as vLLM's multimodal Kimi-K3 names it, and as the
# checkpoint does: ignore lists are written in either spelling.
VLLM_MODULE = "language_model.model.layers.1.block_sparse_moe.{}"
CHECKPOINT_MODULE = "language_model.layers.1.block_sparse_moe.{}"


def adapter_shape(adapter: str, hidden: int, routed: int) -> tuple[int, int]:
    """``[output, input]`` of one adapter's weight."""
    return (
        (routed, hidden) if adapter == "routed_expert_down_proj" else (hidden, routed)
    )


def adapter_contracts(
    tensors: ExpertTensors, adapter: str, hidden: int, routed: int
) -> dict[str, TensorContract]:
    """suffix -> contract of one adapter stored as ``tensors`` stores an
    expert's down projection (w2, ``[output, input]``)."""
    output, input_ = adapter_shape(adapter, hidden, routed)
    return {
        suffix: contract
        for (projection, suffix), contract in tensors.contracts(output, input_).items()
        if projection == "w2"
    }


def adapters_quantized(quantization_config: Any, hf_quant_config: Any) -> bool:
    """Whether vLLM builds the adapters quantized under these config files
    (``config.json``'s ``quantization_config``, ModelOpt's
    ``hf_quant_config.json``): a config quantizes every ``Linear`` it
    targets but those its ignore list names, matched as vLLM matches it."""
    names = [
        spelling.format(adapter)
        for adapter in ADAPTERS
        for spelling in (VLLM_MODULE, CHECKPOINT_MODULE)
    ]
    if isinstance(hf_quant_config, dict):
        quantization = hf_quant_config.get("quantization") or {}
        return not _fnmatch_any(quantization.get("exclude_modules"), names)
    if not isinstance(quantization_config, dict):
        return False
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_targets(quantization_config, names)
    if method == "modelopt":
        ignored = quantization_config.get("ignore") or quantization_config.get(
            "exclude_modules"
        )
        return not _fnmatch_any(ignored, names)
    if method == "awq":  # AutoAWQ's: substrings of the module name
        kept = quantization_config.get("modules_to_not_convert") or ()
        return not any(part in name for part in kept for name in names)
    if method == "gptq":  # GPTQModel's overrides: "-:" skips what it matches
        dynamic = quantization_config.get("dynamic") or {}
        return not any(
            str(key).startswith("-:") and re.match(str(key)[2:], name)
            for key in dynamic
            for name in names
        )
    return True  # the rest: every Linear


def _fnmatch_any(patterns: Any, names: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, str(p)) for p in patterns or () for name in names)


def _compressed_tensors_targets(config: dict[str, Any], names: list[str]) -> bool:
    """Not ignored (``re:`` patterns matched from the start, other entries
    by the whole name), and some config group targets ``Linear`` or them."""
    for entry in config.get("ignore") or ():
        entry = str(entry)
        for name in names:
            if re.match(entry[3:], name) if entry.startswith("re:") else entry == name:
                return False
    groups = config.get("config_groups") or {}
    for group in groups.values() if isinstance(groups, dict) else ():
        for target in (group or {}).get("targets") or ():
            target = str(target)
            if target == "Linear" or any(
                re.match(target[3:], name)
                if target.startswith("re:")
                else target == name
                for name in names
            ):
                return True
    return False
