"""What a built rank allocates, read from its parameters: value types.

``LayerAllocation`` is one MoE layer's (routed experts, shared experts,
latent projections), ``ModelAllocation`` the whole language model's by
component. Both are read from vLLM's built modules (names, shapes, dtypes
of their parameters), never computed from a formula.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROUTED_PARAMETERS = ("experts.routed_experts.w13_", "experts.routed_experts.w2_")
SHARED_PARAMETERS = ("shared_experts.",)
LATENT_PARAMETERS = ("routed_expert_up_proj.", "routed_expert_down_proj.")

COMPONENTS = (
    "embeddings",
    "lm_head",
    "mla_attention",
    "kda_attention",
    "dense_mlp",
    "moe_routed_experts",
    "moe_other",  # shared experts, latent projections, router
    "norms_other",  # layer norms, attention-residual norms and projections
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.")
_ROUTED = re.compile(r"\.block_sparse_moe\.experts\.routed_experts\.(w13|w2)_")


@dataclass(frozen=True)
class LayerAllocation:
    """What one MoE layer allocates on one GPU, read from its parameters."""

    intermediate_per_rank: int
    local_experts: int
    routed_bytes: int
    shared_bytes: int
    latent_bytes: int
    total_bytes: int

    @classmethod
    def of(cls, kimi_moe: Any) -> LayerAllocation:
        sizes = {
            name: p.numel() * p.element_size()
            for name, p in kimi_moe.named_parameters()
        }

        def total(prefixes: tuple[str, ...]) -> int:
            return sum(n for name, n in sizes.items() if name.startswith(prefixes))

        experts = kimi_moe.experts.routed_experts
        return cls(
            intermediate_per_rank=experts.intermediate_size_per_partition,
            local_experts=experts.local_num_experts,
            routed_bytes=total(ROUTED_PARAMETERS),
            shared_bytes=total(SHARED_PARAMETERS),
            latent_bytes=total(LATENT_PARAMETERS),
            total_bytes=sum(sizes.values()),
        )


@dataclass(frozen=True)
class ModelAllocation:
    """What the language model allocates on one GPU, by component (bytes of
    parameters)."""

    components: dict[str, int]
    parameters: int  # count of parameter tensors

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @classmethod
    def of(cls, model: Any, kda_layer: Callable[[int], bool]) -> ModelAllocation:
        """Sum the bytes of every parameter of ``model`` by component;
        ``kda_layer(i)`` says whether 0-based layer ``i`` is KDA."""
        components = dict.fromkeys(COMPONENTS, 0)
        count = 0
        for name, parameter in model.named_parameters():
            components[component_of(name, kda_layer)] += (
                parameter.numel() * parameter.element_size()
            )
            count += 1
        return cls(components=components, parameters=count)


def component_of(name: str, kda_layer: Callable[[int], bool]) -> str:
    """The component a parameter of ``KimiLinearForCausalLM`` belongs to, by
    its name; ``kda_layer(i)`` says whether 0-based layer ``i`` is KDA."""
    if name.startswith("model.embed_tokens."):
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    layer = _LAYER.match(name)
    if layer is None:
        return "norms_other"
    index, part = int(layer.group(1)), layer.group(2)
    if part == "self_attn":
        return "kda_attention" if kda_layer(index) else "mla_attention"
    if part == "mlp":
        return "dense_mlp"
    return "moe_routed_experts" if _ROUTED.search(name) else "moe_other"
