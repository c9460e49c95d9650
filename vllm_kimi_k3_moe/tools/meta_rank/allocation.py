"""What a built rank allocates, read from its parameters: value types.

``LayerAllocation`` is one MoE layer's (routed experts, shared experts,
latent projections), ``ModelAllocation`` the whole language model's by
component. Both are read from vLLM's built modules (names, shapes, dtypes
of their parameters), never computed from a formula.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    "vision_tower",  # MoonViT and its projector, unless --language-model-only
    "speculative_draft",  # --speculative-config's draft, not shared with the target
    # the top-k buffer all DSA layers share (a tensor the model allocates
    # when it is built, not a parameter), on every pipeline stage
    "dsa_topk_indices",
)
MOE_COMPONENTS = ("moe_routed_experts", "moe_other")
# The multimodal model's parts, by their parameters' first name.
LANGUAGE_MODEL = "language_model."
VISION = ("vision_tower.", "mm_projector.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.")
_ANY_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Built on the first or the last pipeline stage only (KimiLinearModel,
# KimiLinearForCausalLM: is_first_rank / is_last_rank).
FIRST_STAGE = ("model.embed_tokens.", *VISION)
LAST_STAGE = ("lm_head.", "model.norm.", "model.output_attn_res_")
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
    # built with the plugin: why vLLM alone's partition, which it builds,
    # its kernel cannot run (the plugin's ``PartitionChoice``)
    vllm_alone_refused: str | None = None
    # built with the plugin: the rows vLLM alone's kernel keeps once its
    # weight preparation padded vLLM alone's partition again (None: as built)
    vllm_alone_resident: int | None = None
    # built with the plugin: why its partition (the plugin's ``PartitionChoice``);
    # words, not what is allocated: two allocations are equal without them
    partition_reason: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, kimi_moe: Any) -> LayerAllocation:
        sizes = {
            name: p.numel() * p.element_size()
            for name, p in kimi_moe.named_parameters()
        }

        def total(prefixes: tuple[str, ...]) -> int:
            return sum(n for name, n in sizes.items() if name.startswith(prefixes))

        experts = kimi_moe.experts.routed_experts
        choice = getattr(experts, "kimi_k3_partition", None)
        return cls(
            intermediate_per_rank=experts.intermediate_size_per_partition,
            local_experts=experts.local_num_experts,
            routed_bytes=total(ROUTED_PARAMETERS),
            shared_bytes=total(SHARED_PARAMETERS),
            latent_bytes=total(LATENT_PARAMETERS),
            total_bytes=sum(sizes.values()),
            vllm_alone_refused=getattr(choice, "upstream_refused", None),
            vllm_alone_resident=_resident_apart(choice),
            partition_reason=getattr(choice, "reason", None),
        )

    def with_routed_bytes(self, routed_bytes: int) -> LayerAllocation:
        """This layer with its routed experts at ``routed_bytes`` (what they
        keep once quantized while loading, ``online_experts``)."""
        added = routed_bytes - self.routed_bytes
        return replace(
            self, routed_bytes=routed_bytes, total_bytes=self.total_bytes + added
        )

    def kept_by_its_kernel(self, rows: int, other: LayerAllocation) -> LayerAllocation:
        """This layer as its kernel keeps it once its weight preparation padded
        it to ``rows``, from two builds of the same kernel: its routed
        experts' bytes are affine in the rows (every per-expert tensor but
        the per-expert scalars spans them), so this build and ``other``, at
        another partition, give the bytes at ``rows``."""
        span = other.intermediate_per_rank - self.intermediate_per_rank
        per_row, remainder = divmod(other.routed_bytes - self.routed_bytes, span)
        assert remainder == 0, "routed-expert bytes are not affine in the rows"
        added = per_row * (rows - self.intermediate_per_rank)
        return replace(
            self,
            intermediate_per_rank=rows,
            routed_bytes=self.routed_bytes + added,
            total_bytes=self.total_bytes + added,
        )


def _resident_apart(choice: Any) -> int | None:
    """The rows vLLM alone's kernel keeps, where its weight preparation pads
    vLLM alone's partition again and the plugin allocates another one (the
    two builds then give the bytes at those rows). Where the plugin keeps
    vLLM alone's partition (no smaller one builds on its kernel), both are
    sized as allocated."""
    resident = getattr(choice, "upstream_resident", None)
    upstream = getattr(choice, "upstream", None)
    if resident in (None, upstream) or choice.allocated == upstream:
        return None
    return resident


@dataclass(frozen=True)
class ModelAllocation:
    """What the language model allocates on one GPU, by component (bytes of
    parameters)."""

    components: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @classmethod
    def of(cls, model: Any, kda_layer: Callable[[int], bool]) -> ModelAllocation:
        """Sum the bytes of every parameter of ``model`` by component;
        ``kda_layer(i)`` says whether 0-based layer ``i`` is KDA."""
        components = dict.fromkeys(COMPONENTS, 0)
        for name, parameter in model.named_parameters():
            components[component_of(name, kda_layer)] += (
                parameter.numel() * parameter.element_size()
            )
        return cls(components=components)


def component_of(name: str, kda_layer: Callable[[int], bool]) -> str:
    """The component a parameter of ``KimiK3ForConditionalGeneration`` (or
    of its ``KimiLinearForCausalLM``) belongs to, by its name;
    ``kda_layer(i)`` says whether 0-based layer ``i`` is KDA."""
    name = name.removeprefix(LANGUAGE_MODEL)
    if name.startswith(VISION):
        return "vision_tower"
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


@dataclass(frozen=True)
class PlacedAllocation:
    """A rank's parameter bytes by where a pipeline stage holds them: per
    decoder layer, on the first stage only (embeddings; the vision tower,
    which vLLM's model runner builds there alone), on the last stage only
    (final norms, ``lm_head``) and on every stage (anything else), each by
    component. Read from a build without pipeline parallelism; a stage's
    share is the sum of its places (``stage``)."""

    layers: tuple[dict[str, int], ...]
    first: dict[str, int]
    last: dict[str, int]
    every: dict[str, int]

    @classmethod
    def of(
        cls, model: Any, num_layers: int, kda_layer: Callable[[int], bool]
    ) -> PlacedAllocation:
        layers = [dict.fromkeys(COMPONENTS, 0) for _ in range(num_layers)]
        first, last, every = (dict.fromkeys(COMPONENTS, 0) for _ in range(3))
        for name, parameter in model.named_parameters():
            size = parameter.numel() * parameter.element_size()
            name = name.removeprefix(LANGUAGE_MODEL)
            layer = _ANY_LAYER.match(name)
            if layer is not None:
                place = layers[int(layer.group(1))]
            elif name.startswith(FIRST_STAGE):
                place = first
            elif name.startswith(LAST_STAGE):
                place = last
            else:
                place = every
            place[component_of(name, kda_layer)] += size
        return cls(tuple(layers), first, last, every)

    def with_draft(self, draft_bytes: int) -> PlacedAllocation:
        """This model with a speculative draft of ``draft_bytes`` on the last
        pipeline stage, where vLLM's model runner loads the drafter."""
        last = {**self.last, "speculative_draft": draft_bytes}
        return PlacedAllocation(self.layers, self.first, last, self.every)

    def with_every_stage(self, component: str, size: int) -> PlacedAllocation:
        """This model with ``size`` bytes of ``component`` that every
        pipeline stage allocates (not a parameter of any layer)."""
        every = {**self.every, component: size}
        return PlacedAllocation(self.layers, self.first, self.last, every)

    def with_mlps_of(self, other: PlacedAllocation) -> PlacedAllocation:
        """This model with every layer's MLP (dense or MoE) as ``other``'s
        first layer of that kind has it, and ``other``'s draft: ``other`` is a
        small model built under another data-parallel size, which shards the
        MoE layers' experts over TP x DP and, with expert parallelism,
        replicates the dense MLP (an MTP draft's MoE layer too); attention,
        embeddings and norms depend on TP alone."""
        dense = next(layer for layer in other.layers if layer["dense_mlp"])
        moe = next(layer for layer in other.layers if layer["moe_routed_experts"])
        layers = tuple(
            {
                **layer,
                **(
                    {name: moe[name] for name in MOE_COMPONENTS}
                    if layer["moe_routed_experts"]
                    else {"dense_mlp": dense["dense_mlp"]}
                ),
            }
            for layer in self.layers
        )
        last = {**self.last, "speculative_draft": other.last["speculative_draft"]}
        return PlacedAllocation(layers, self.first, last, self.every)

    def with_routed_bytes(self, routed_bytes: int) -> PlacedAllocation:
        """This model with every MoE layer's routed experts at
        ``routed_bytes`` (what their kernel keeps)."""
        layers = tuple(
            {**layer, "moe_routed_experts": routed_bytes}
            if layer["moe_routed_experts"]
            else layer
            for layer in self.layers
        )
        return PlacedAllocation(layers, self.first, self.last, self.every)

    def stage(
        self, start: int, end: int, is_first: bool, is_last: bool
    ) -> ModelAllocation:
        """What a pipeline stage holding layers [start, end) allocates."""
        places = [*self.layers[start:end], self.every]
        places += [self.first] * is_first + [self.last] * is_last
        components = {name: sum(place[name] for place in places) for name in COMPONENTS}
        return ModelAllocation(components=components)
