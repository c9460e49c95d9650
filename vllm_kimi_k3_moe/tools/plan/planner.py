"""Per-GPU memory of Kimi-K3 for one deployment, from real vLLM layers.

For a deployment (TP, DP, expert parallelism, published format and MoE
kernel), ``plan_deployment`` builds vLLM 0.33.0's whole Kimi-K3 language model
for rank 0 on the ``meta`` device twice, as upstream builds it and with this
plugin (``whole_model``), reads the shape and dtype of every parameter, and
sizes the KV cache vLLM would allocate next to each (``kv_cache``). ``plan``
builds one MoE layer alone, for ``check --moe-backend``.
``deployment.validate`` refuses topologies that split the experts, the
intermediate size or the attention heads unevenly, so every rank allocates
what rank 0 does and rank 0 stands for each GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm_kimi_k3_moe.tools.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.text_config import moe_layer_count
from vllm_kimi_k3_moe.tools.topology import (
    Deployment,
    Serving,
    validate,
    validate_backend,
    validate_parallelism,
    validate_serving,
)

if TYPE_CHECKING:
    from vllm_kimi_k3_moe.tools.build.kv_cache import KvCacheShape, KvCapacity
    from vllm_kimi_k3_moe.tools.build.whole_model import ModelAllocation

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


def _build(kimi_moe_cls: type, text_config: dict[str, Any], deployment: Deployment):
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    from vllm_kimi_k3_moe.tools.build.rank import (
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
    """Size ``deployment``'s MoE layers alone by building its rank-0 MoE layer,
    upstream and fixed (``check --moe-backend``: a checkpoint's text config
    need not describe its attention)."""
    validate_backend(deployment.quantization, deployment.backend)
    validate_parallelism(text_config, deployment)
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


@dataclass(frozen=True)
class DeploymentPlan:
    """Everything ``plan`` reports for one deployment, read from vLLM's whole
    language model built for rank 0 upstream and with the plugin: the
    MoE-layer figures, the whole model's weights per GPU by component, the
    KV cache's make-up and, given a GPU budget, what vLLM would allocate of
    it next to each model."""

    moe: MoeMemoryPlan
    serving: Serving
    upstream: ModelAllocation
    fixed: ModelAllocation
    kv_cache: KvCacheShape
    budget: GpuBudget | None = None
    upstream_kv: KvCapacity | None = None
    fixed_kv: KvCapacity | None = None

    @property
    def deployment(self) -> Deployment:
        return self.moe.deployment

    def to_dict(self) -> dict[str, Any]:
        document = self.moe.to_dict()
        document["whole_model"] = {
            "upstream_bytes": self.upstream.total_bytes,
            "fixed_bytes": self.fixed.total_bytes,
            "upstream_components": self.upstream.components,
            "fixed_components": self.fixed.components,
        }
        document["serving"] = asdict(self.serving)
        document["kv_cache_per_gpu"] = asdict(self.kv_cache)
        if self.budget is not None:
            assert self.upstream_kv is not None and self.fixed_kv is not None
            document["gpu"] = {
                **asdict(self.budget),
                "requested_bytes": self.budget.requested_bytes,
            }
            document["kv_cache"] = {
                "upstream_tokens": self.upstream_kv.tokens,
                "fixed_tokens": self.fixed_kv.tokens,
                "upstream_available_bytes": self.upstream_kv.available_bytes,
                "fixed_available_bytes": self.fixed_kv.available_bytes,
                "upstream_max_concurrency": self.upstream_kv.concurrency,
                "fixed_max_concurrency": self.fixed_kv.concurrency,
                "upstream_refusal": self.upstream_kv.refusal,
                "fixed_refusal": self.fixed_kv.refusal,
            }
        return document


def plan_deployment(
    text_config: dict[str, Any],
    deployment: Deployment,
    serving: Serving | None = None,
    budget: GpuBudget | None = None,
) -> DeploymentPlan:
    """Build vLLM's whole Kimi-K3 language model for rank 0 of ``deployment``,
    upstream and fixed, in the deployment's published format, and size it.
    ``text_config`` is a whole text config (``KIMI_K3_TEXT_CONFIG`` or a
    ``config.json``'s)."""
    import tempfile
    from pathlib import Path

    from vllm_kimi_k3_moe.tools.build.kv_cache import KvCachePlanner
    from vllm_kimi_k3_moe.tools.build.whole_model import build_rank, write_architecture

    serving = serving or Serving()
    validate(text_config, deployment)
    validate_serving(serving)
    upstream_cls, fixed_cls = kimi_moe_classes()
    with tempfile.TemporaryDirectory(prefix="kimi-k3-config-") as directory:
        try:
            architecture = write_architecture(
                text_config, deployment, serving, Path(directory)
            )
            upstream, fixed = (
                build_rank(cls, text_config, deployment, serving, architecture)
                for cls in (upstream_cls, fixed_cls)
            )
        except (AssertionError, TypeError, ValueError, RuntimeError) as error:
            raise PlanError(
                f"vLLM 0.33.0 cannot build Kimi-K3 for {deployment.label()} in "
                f"{deployment.quantization} on {deployment.backend}: "
                f"{type(error).__name__}: {error}".replace("\n", " ")
            ) from error
    kv_cache = KvCachePlanner(fixed.vllm_config)
    moe = MoeMemoryPlan(
        deployment=deployment,
        moe_layers=moe_layer_count(text_config),
        logical_intermediate_per_rank=deployment.intermediate_per_gpu(
            text_config["moe_intermediate_size"]
        ),
        upstream=upstream.moe_layer,
        fixed=fixed.moe_layer,
    )
    plan = DeploymentPlan(
        moe=moe,
        serving=serving,
        upstream=upstream.allocation,
        fixed=fixed.allocation,
        kv_cache=kv_cache.shape,
    )
    if budget is None:
        return plan
    return replace(
        plan,
        budget=budget,
        upstream_kv=kv_cache.capacity(
            budget.kv_cache_bytes(upstream.allocation.total_bytes)
        ),
        fixed_kv=kv_cache.capacity(budget.kv_cache_bytes(fixed.allocation.total_bytes)),
    )
