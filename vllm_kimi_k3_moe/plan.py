"""Per-GPU memory of Kimi-K3's MoE layers for one deployment, from real vLLM layers.

For a deployment (TP, DP, expert parallelism, MXFP4 path and kernel), vLLM
0.33.0's own ``KimiMoE`` is built for rank 0 on the ``meta`` device twice, as
upstream builds it and with this plugin, and the shape and dtype of every
parameter it allocates are read. ``deployment.validate`` refuses topologies
that split the experts or the intermediate size unevenly, so every rank
allocates what rank 0 does and rank 0 stands for each GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_kimi_k3_moe.deployment import Deployment, validate
from vllm_kimi_k3_moe.kimi_k3_text_config import moe_layer_count

GIB = 2**30
ROUTED_PARAMETERS = ("experts.routed_experts.w13_", "experts.routed_experts.w2_")
SHARED_PARAMETERS = ("shared_experts.",)
LATENT_PARAMETERS = ("routed_expert_up_proj.", "routed_expert_down_proj.")


class PlanError(ValueError):
    """vLLM cannot build a deployment that passed ``validate``, or the plugin
    did not patch it; the message is one line."""


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
class MoeMemoryPlan:
    """Per-GPU MoE memory of one deployment, upstream vLLM and with the fix."""

    deployment: Deployment
    moe_layers: int
    logical_intermediate_per_rank: int
    upstream: LayerAllocation
    fixed: LayerAllocation

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
            "upstream_per_layer": asdict(self.upstream),
            "fixed_per_layer": asdict(self.fixed),
            "floor_routed_bytes_per_layer": self.floor_routed_bytes,
            "all_moe_layers": self.all_moe_layers,
        }

    @property
    def all_moe_layers(self) -> dict[str, int]:
        """Per-GPU bytes summed over the model's MoE layers."""
        per_layer = {
            "upstream_routed_bytes": self.upstream.routed_bytes,
            "fixed_routed_bytes": self.fixed.routed_bytes,
            "floor_routed_bytes": self.floor_routed_bytes,
            "shared_bytes": self.fixed.shared_bytes,
            "latent_bytes": self.fixed.latent_bytes,
            "upstream_total_bytes": self.upstream.total_bytes,
            "fixed_total_bytes": self.fixed.total_bytes,
        }
        return {name: n * self.moe_layers for name, n in per_layer.items()}

    def fits(self, gpu_memory_gib: float) -> dict[str, bool]:
        """Whether all MoE-layer weights fit in ``gpu_memory_gib`` per GPU."""
        totals = self.all_moe_layers
        budget = gpu_memory_gib * GIB
        return {
            "upstream": totals["upstream_total_bytes"] <= budget,
            "fixed": totals["fixed_total_bytes"] <= budget,
        }


def _build(kimi_moe_cls: type, text_config: dict[str, Any], deployment: Deployment):
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    from vllm_kimi_k3_moe.simulated_rank import (
        build_kimi_moe_layer,
        rank_vllm_config,
        rank_zero_of,
    )

    with rank_zero_of(deployment) as topology:
        vllm_config = rank_vllm_config(topology, deployment.quantization)
        try:
            return build_kimi_moe_layer(
                kimi_moe_cls, KimiLinearConfig(**text_config), vllm_config
            )
        except (AssertionError, TypeError, ValueError, RuntimeError) as error:
            raise PlanError(
                f"vLLM 0.33.0 cannot build the Kimi-K3 MoE layer for "
                f"{deployment.label()}: {type(error).__name__}: {error}"
            ) from error


def kimi_moe_classes() -> tuple[type, type]:
    """(upstream ``KimiMoE``, patched ``KimiMoE``), importing vLLM's model."""
    import importlib

    import vllm_kimi_k3_moe
    from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import (
        BackendPaddedKimiMoE,
        upstream_kimi_moe,
    )

    vllm_kimi_k3_moe.register()
    model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    if not issubclass(model.KimiMoE, BackendPaddedKimiMoE):
        raise PlanError(
            "the plugin did not patch vLLM's Kimi-K3 model (see the warning "
            "above): the planner needs vLLM 0.33.x on a non-ROCm platform"
        )
    return upstream_kimi_moe(model), model.KimiMoE


def plan(text_config: dict[str, Any], deployment: Deployment) -> MoeMemoryPlan:
    """Size ``deployment`` by building its rank-0 MoE layer, upstream and fixed."""
    validate(text_config, deployment)
    upstream_cls, fixed_cls = kimi_moe_classes()
    return MoeMemoryPlan(
        deployment=deployment,
        moe_layers=moe_layer_count(text_config),
        logical_intermediate_per_rank=deployment.intermediate_per_gpu(
            text_config["moe_intermediate_size"]
        ),
        upstream=LayerAllocation.of(_build(upstream_cls, text_config, deployment)),
        fixed=LayerAllocation.of(_build(fixed_cls, text_config, deployment)),
    )
