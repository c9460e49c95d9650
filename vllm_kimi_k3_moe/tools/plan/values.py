"""What ``plan`` reports for one deployment: value types.

Read from vLLM's language model built for rank 0, upstream and with the
plugin (``tools.meta_rank``); rendered by ``report``. Where vLLM alone cannot
build a layout the plugin builds (FP8 blocks or INT groups of 128 with every
expert split 32 ways through data parallelism), its side is None and
``MoeMemoryPlan.upstream_refusal`` says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.tools.deployment.kv_budget import KvBudget
from vllm_kimi_k3_moe.tools.deployment.nodes import NodeSplit
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.allocation import LayerAllocation, ModelAllocation
from vllm_kimi_k3_moe.tools.meta_rank.kv_cache import KvCacheShape, KvCapacity

GB = 10**9  # the unit of every size plan reports per GPU


@dataclass(frozen=True)
class MoeMemoryPlan:
    """Per-GPU MoE memory of one deployment, upstream vLLM and with the fix."""

    deployment: Deployment
    moe_layers: int
    logical_intermediate_per_rank: int
    upstream: LayerAllocation | None  # None: vLLM alone cannot build it
    fixed: LayerAllocation
    # why vLLM alone cannot build it (its error, one line), or cannot run it
    # (its kernel refuses the partition it builds)
    upstream_refusal: str | None = None

    @property
    def floor_routed_bytes(self) -> int:
        """Routed-expert bytes of a layer allocated at exactly the logical
        per-rank size: the fixed allocation without its kernel padding (every
        routed tensor is linear in the per-rank intermediate)."""
        return (
            self.fixed.routed_bytes
            * self.logical_intermediate_per_rank
            // self.fixed.intermediate_per_rank
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment": {**asdict(self.deployment), "gpus": self.deployment.gpus},
            "moe_layers": self.moe_layers,
            "logical_intermediate_per_rank": self.logical_intermediate_per_rank,
            "upstream_per_layer": self.upstream and asdict(self.upstream),
            "upstream_refusal": self.upstream_refusal,
            "fixed_per_layer": asdict(self.fixed),
            "floor_routed_bytes_per_layer": self.floor_routed_bytes,
            "all_moe_layers": self.all_moe_layers,
        }

    @property
    def all_moe_layers(self) -> dict[str, int | None]:
        """Per-GPU bytes summed over the model's MoE layers (vLLM alone's
        None where it cannot build the layout)."""
        upstream = self.upstream
        per_layer = {
            "upstream_routed_bytes": upstream and upstream.routed_bytes,
            "fixed_routed_bytes": self.fixed.routed_bytes,
            "floor_routed_bytes": self.floor_routed_bytes,
            "shared_bytes": self.fixed.shared_bytes,
            "latent_bytes": self.fixed.latent_bytes,
            "upstream_total_bytes": upstream and upstream.total_bytes,
            "fixed_total_bytes": self.fixed.total_bytes,
        }
        return {
            name: None if n is None else n * self.moe_layers
            for name, n in per_layer.items()
        }


@dataclass(frozen=True)
class StageAllocation:
    """What each GPU of one pipeline stage allocates, upstream and fixed."""

    index: int
    layers: tuple[int, int]  # the decoder layers it holds: [start, end)
    upstream: ModelAllocation | None  # None: vLLM alone cannot build it
    fixed: ModelAllocation

    def to_dict(self) -> dict[str, Any]:
        upstream = self.upstream
        return {
            "index": self.index,
            "layers": list(self.layers),
            "upstream_bytes": upstream and upstream.total_bytes,
            "fixed_bytes": self.fixed.total_bytes,
            "upstream_components": upstream and upstream.components,
            "fixed_components": self.fixed.components,
        }


def _heaviest(stages: tuple[StageAllocation, ...], side: str) -> ModelAllocation:
    return max((getattr(s, side) for s in stages), key=lambda a: a.total_bytes)


@dataclass(frozen=True)
class DeploymentPlan:
    """Everything ``plan`` reports for one deployment, read from vLLM's
    language model built for rank 0 upstream and with the plugin: the
    MoE-layer figures, each pipeline stage's weights per GPU by component
    (``upstream``/``fixed``: the heaviest stage's), the KV cache's make-up
    and, given a GPU budget, what vLLM would allocate of it next to each
    model, the nodes it takes and each node's ``vllm serve`` line."""

    moe: MoeMemoryPlan
    serving: Serving
    stages: tuple[StageAllocation, ...]
    kv_cache: KvCacheShape
    serve_commands: tuple[str, ...]  # each node's line, node 0's first
    nodes: NodeSplit
    speculative_config: dict[str, Any] | None = None  # as given, and sized
    not_counted: tuple[str, ...] = ()  # what vllm serve holds that is not here
    budget: KvBudget | None = None  # the GPU as vLLM shares it out
    upstream_kv: KvCapacity | None = None
    fixed_kv: KvCapacity | None = None

    @property
    def deployment(self) -> Deployment:
        return self.moe.deployment

    @property
    def serve_command(self) -> str:
        """Node 0's ``vllm serve`` line (the only one on one node)."""
        return self.serve_commands[0]

    @property
    def upstream(self) -> ModelAllocation | None:
        """vLLM alone's heaviest stage; None where it cannot build it."""
        if any(stage.upstream is None for stage in self.stages):
            return None
        return _heaviest(self.stages, "upstream")

    @property
    def fixed(self) -> ModelAllocation:
        return _heaviest(self.stages, "fixed")

    def kv(self, side: str) -> KvCapacity | None:
        """The KV cache vLLM would allocate (``side``: upstream or fixed);
        None without a GPU size."""
        return self.upstream_kv if side == "upstream" else self.fixed_kv

    def fits(self, side: str) -> bool | None:
        """Whether vLLM would start (``side``: upstream or fixed); None
        without a GPU size."""
        if self.budget is None:
            return None
        if side == "upstream" and self.moe.upstream_refusal is not None:
            return False
        capacity = self.kv(side)
        return capacity is not None and capacity.tokens > 0

    @property
    def advised_command(self) -> str | None:
        """The ``vllm serve`` command plan stands behind: where the layout
        fits with the plugin on the GPU size given; None where it does not
        or, without a GPU size, where plan cannot tell."""
        return self.serve_command if self.fits("fixed") else None

    @property
    def plugin_makes_it_fit(self) -> bool:
        return bool(self.fits("fixed")) and not self.fits("upstream")

    def reason(self, side: str = "fixed") -> str | None:
        """Why it does not fit, in a few words; None when it fits or without
        a GPU size."""
        if side == "upstream" and self.moe.upstream_refusal is not None:
            cannot = "run" if self.moe.upstream is not None else "build"
            return f"{VLLM} alone cannot {cannot} it: {self.moe.upstream_refusal}"
        capacity = self.kv(side)
        if capacity is None or capacity.tokens > 0 or self.budget is None:
            return None
        stage = f"stage {capacity.binding_stage} " if len(self.stages) > 1 else ""
        if capacity.available_bytes <= 0:  # in GB, as the weights columns
            weights = getattr(self.stages[capacity.binding_stage], side)
            need = (weights.total_bytes + self.budget.reserve_bytes) / GB
            return (
                f"{stage}weights+reserve {need:.1f} > "
                f"{self.budget.requested_bytes / GB:.1f} GB"
            )
        longest = capacity.fitting_max_model_len
        if longest:
            return f"{stage}KV < 1 request ({longest} tokens fit)"
        return f"{stage}KV < 1 request of --max-model-len"

    def to_dict(self) -> dict[str, Any]:
        document = self.moe.to_dict()
        upstream = self.upstream
        document["whole_model"] = {
            "upstream_bytes": upstream and upstream.total_bytes,
            "fixed_bytes": self.fixed.total_bytes,
            "upstream_components": upstream and upstream.components,
            "fixed_components": self.fixed.components,
        }
        if len(self.stages) > 1:
            document["stages"] = [stage.to_dict() for stage in self.stages]
        document["not_counted"] = list(self.not_counted)
        document["serving"] = asdict(self.serving)
        document["kv_cache_per_gpu"] = asdict(self.kv_cache)
        if self.budget is not None:
            assert self.fixed_kv is not None
            alone = self.upstream_kv  # None: vLLM alone cannot build it
            document["gpu"] = self.budget.to_dict()
            document["kv_cache"] = {
                "upstream_tokens": alone.tokens if alone else 0,
                "fixed_tokens": self.fixed_kv.tokens,
                "upstream_available_bytes": alone and alone.available_bytes,
                "fixed_available_bytes": self.fixed_kv.available_bytes,
                "upstream_max_concurrency": alone.concurrency if alone else 0.0,
                "fixed_max_concurrency": self.fixed_kv.concurrency,
                "upstream_refusal": alone.refusal if alone else self.reason("upstream"),
                "fixed_refusal": self.fixed_kv.refusal,
                "binding_stage": self.fixed_kv.binding_stage,
            }
            document["fits"] = {
                "gpu_memory_gib": self.budget.gpu_memory_gib,
                "upstream": self.fits("upstream"),
                "fixed": self.fits("fixed"),
                "plugin_makes_it_fit": self.plugin_makes_it_fit,
            }
            document["reason"] = self.reason()
        document["nodes"] = asdict(self.nodes)
        document["speculative_config"] = self.speculative_config
        # the lines plan stands behind: none where the layout does not fit
        advised = self.advised_command is not None
        document["serve_command"] = self.advised_command
        document["serve_commands"] = list(self.serve_commands) if advised else None
        return document
