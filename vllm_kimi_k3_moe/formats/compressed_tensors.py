"""What the compressed-tensors formats share: the config block and its parts.

The published ``quantization_config`` blocks of the compressed-tensors
formats have the same frame (one config group targeting ``Linear``, an ignore
list); each format module fills in its weights, input activations and ignore
list. Names in ignore lists are spelt as both the checkpoint and vLLM's
modules spell them.
"""

from __future__ import annotations

import re
from typing import Any

ROUTER = r"re:.*block_sparse_moe\.gate$"
ATTENTION = r"re:.*self_attn\..*"
# Built unquantized by vLLM whatever the config says; listed as checkpoints do.
ATTENTION_RESIDUALS = r"re:.*_res_proj"
# The vision tower and its projector stay BF16, as in the release.
VISION = [r"re:.*vision_tower.*", r"re:.*mm_projector.*"]
EVERYTHING_BUT_ROUTED_EXPERTS = [
    *VISION,
    "lm_head",
    ATTENTION,
    r"re:.*\.mlp\..*",
    r"re:.*block_sparse_moe\.shared_experts\..*",
    r"re:.*block_sparse_moe\.routed_expert_(up|down)_proj",
    ROUTER,
    ATTENTION_RESIDUALS,
]

# A routed expert's module name as compressed-tensors matches its targets.
EXPERT_MODULE = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"


def compressed_tensors_config(
    fmt: str, weights: dict[str, Any], inputs: dict[str, Any] | None, ignore: list[str]
) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` with one group."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def expert_weights(config: dict[str, Any]) -> dict[str, Any] | None:
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


def weight_signature(weights: dict[str, Any] | None) -> tuple[Any, ...]:
    """(num_bits, type, strategy, group_size) of an expert weight scheme."""
    weights = weights or {}
    return tuple(
        weights.get(key) for key in ("num_bits", "type", "strategy", "group_size")
    )
