"""The partition rule of a quantization method no format of the registry
names, learned from vLLM's own objects.

Asked by ``kernel_rows.rule_of`` for ``partition.LayoutChooser`` inside a
``KimiMoE`` build. A method the registry (``vllm_kimi_k3_moe.formats``) does
not name (vLLM's native FP8, ModelOpt FP8 and MXFP8, compressed-tensors
MXFP8, FP8 or INT4 per channel, a method vLLM adds) is asked, not listed:

- which rows share a scale or a packed element: its ``create_weights`` is
  run on a scratch module on the ``meta`` device (no memory) at two
  partitions, and every per-expert tensor whose extent follows the rows
  says how many rows one of its elements spans (w13 holds gate and up:
  ``2 x rows / extent``, w2 ``rows / extent``); the rule's group is their
  least common multiple, so a GPU holding whole groups holds whole scales;
- its ``maybe_roundup_sizes`` and its constructor's checks: the chooser's
  trial builds, as for every rule;
- what its kernel keeps after its weight preparation
  (``kernel_rows.resident``).

A GPU's pad of integer weights (int32-packed) keeps zero scales: a zero code
is not a zero value there. Where ``create_weights`` cannot be run on a
scratch module, there is no rule and the chooser keeps vLLM alone's
partition. An online method (``online.is_online``: it quantizes BF16 weights
while vLLM loads them) is not asked here (its ``create_weights`` allocates
the BF16 it loads, one element per row: group 1) but what it quantizes to,
whose scale blocks, packing and kernel preparation decide its rows
(``online.quantized_rule``; ``kernel_rows.rule_of`` asks that one instead).
"""

from __future__ import annotations

import math
from typing import Any

from vllm_kimi_k3_moe.formats.record import PartitionRule

PREFIXES = ("w13_", "w2_")


def _scratch(config: Any, rows: int) -> Any:
    """A bare module with what methods' ``create_weights`` read of the
    ``RoutedExperts`` layer they fill."""
    from torch import nn

    layer = nn.Module()
    layer.moe_config = config
    layer.hidden_size = config.hidden_dim
    layer.intermediate_size_per_partition = rows
    layer.num_experts = 1
    layer.local_num_experts = 1
    layer.global_num_experts = 1
    return layer


def _expert_tensors(method: Any, config: Any, rows: int) -> dict[str, Any]:
    """The per-expert tensors ``method`` allocates for a partition of
    ``rows``, on the meta device."""
    import torch

    layer = _scratch(config, rows)
    with torch.device("meta"):
        method.create_weights(
            layer=layer,
            num_experts=1,
            hidden_size=config.hidden_dim,
            unpadded_hidden_size=config.hidden_dim,
            intermediate_size_per_partition=rows,
            params_dtype=config.in_dtype,
            weight_loader=None,
            global_num_experts=1,
        )
    return {
        name: param
        for name, param in layer.named_parameters()
        if name.startswith(PREFIXES) and param.dim() == 3
    }


def _rows_per_element(name: str, rows: int, extent: int) -> int:
    spanned = 2 * rows if name.startswith("w13_") else rows
    return spanned // extent


def learned_rule(method: Any, config: Any) -> PartitionRule | None:
    """The rule of ``method`` (built for ``config``, a ``FusedMoEConfig``),
    from the tensors its ``create_weights`` allocates; None where they
    cannot be had. Not for an online method (``online.quantized_rule``)."""
    whole = config.intermediate_size
    try:
        at_whole = _expert_tensors(method, config, whole)
        at_half = _expert_tensors(method, config, whole // 2)
    except Exception:  # a method that needs more of a real layer: no rule
        return None
    group = 1
    for name, tensor in at_whole.items():
        dim = 1 if name.startswith("w13_") else 2
        full, half = tensor.shape[dim], at_half[name].shape[dim]
        if full == half:  # does not follow the rows
            continue
        group = math.lcm(group, _rows_per_element(name, whole, full))
    int32_packed = any(
        t.dtype.itemsize == 4 and not t.dtype.is_floating_point
        for t in at_whole.values()
    )
    return PartitionRule(
        f"learned from {type(method).__name__}.create_weights: "
        f"{group} rows per scale group",
        row_group=lambda method: group,
        zero_pad_scales=int32_packed,
    )
