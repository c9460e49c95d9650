"""A checkpoint pruned layer by layer: its MoE layers hold different expert counts.

Pruning each layer on its own (rather than REAP's same count everywhere)
leaves layer L with experts 0 to n_L - 1, n_L differing between layers.
vLLM reads ``num_experts`` alone and builds every MoE layer with it, so the
lighter layers' missing experts are a thousand problems with one cause; this
names it in one line. Dictionary scans only, and only when something is
wrong.
"""

from __future__ import annotations

import re
from collections import defaultdict

from vllm_kimi_k3_moe.formats.safetensors_headers import HeaderTensor
from vllm_kimi_k3_moe.tools.check.layout import KimiK3Layout

# What the verdict asks for instead of the declared-format fix.
PRUNED_PER_LAYER_FIX = "prune every MoE layer to the same expert count"
_EXPERT = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


def experts_by_layer(
    layout: KimiK3Layout, tensors: dict[str, HeaderTensor]
) -> dict[int, int]:
    """MoE layer -> how many experts it holds, where they are experts 0 to
    n - 1 with none missing (a layer with a gap is a broken one, not a
    pruned one, and is left out)."""
    held: dict[int, set[int]] = defaultdict(set)
    for name in tensors:
        if name.startswith(layout.prefix) and (found := _EXPERT.search(name)):
            held[int(found[1])].add(int(found[2]))
    return {
        layer: len(experts)
        for layer, experts in held.items()
        if layer in layout.layers and max(experts) == len(experts) - 1
    }


def pruned_per_layer(
    layout: KimiK3Layout, tensors: dict[str, HeaderTensor]
) -> str | None:
    """The one line that explains the problems when the MoE layers hold
    different expert counts; None when they do not."""
    counts = experts_by_layer(layout, tensors)
    if len(set(counts.values())) < 2:
        return None
    fewest = min(counts, key=counts.__getitem__)
    most = max(counts, key=counts.__getitem__)
    return (
        f"the MoE layers hold different numbers of experts (layer {fewest}: "
        f"{counts[fewest]}, layer {most}: {counts[most]}); vLLM builds every "
        f"MoE layer with config.json's num_experts ({layout.num_experts}), so "
        "a checkpoint pruned layer by layer cannot be served"
    )
