"""Size one Kimi-K3 deployment per GPU by building vLLM's model for rank 0.

For a deployment (TP, DP, expert parallelism, published format and MoE
kernel), ``plan_deployment`` builds vLLM 0.33.0's whole Kimi-K3 language model
for rank 0 on the ``meta`` device twice, as upstream builds it and with this
plugin (``tools.build.whole_model``), reads the shape and dtype of every
parameter, and sizes the KV cache vLLM would allocate next to each
(``tools.build.kv_cache``). ``topology.validate`` refuses topologies that
split the experts, the intermediate size or the attention heads unevenly, so
every rank allocates what rank 0 does and rank 0 stands for each GPU.
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.build.kv_cache import KvCachePlanner
from vllm_kimi_k3_moe.tools.build.vllm_config import (
    served_quantization_config,
    write_model_dir,
)
from vllm_kimi_k3_moe.tools.build.whole_model import build_rank
from vllm_kimi_k3_moe.tools.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan, MoeMemoryPlan
from vllm_kimi_k3_moe.tools.text_config import moe_layer_count
from vllm_kimi_k3_moe.tools.topology import (
    Deployment,
    Serving,
    validate,
    validate_serving,
)


class PlanError(ValueError):
    """vLLM cannot build a deployment that passed ``validate``, or the plugin
    did not patch it; the message is one line."""


def kimi_moe_classes() -> tuple[type, type]:
    """(upstream ``KimiMoE``, patched ``KimiMoE``), importing vLLM's model."""
    vllm_kimi_k3_moe.register()
    model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    upstream = upstream_class(model.KimiMoE)
    if model.KimiMoE is upstream:
        raise PlanError(
            "the plugin did not patch vLLM's Kimi-K3 model (see the warning "
            f"above): the planner needs {VLLM} on a non-ROCm platform"
        )
    return upstream, model.KimiMoE


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
    serving = serving or Serving()
    validate(text_config, deployment)
    validate_serving(serving)
    upstream_cls, fixed_cls = kimi_moe_classes()
    with tempfile.TemporaryDirectory(prefix="kimi-k3-config-") as directory:
        try:
            model_dir = write_model_dir(
                text_config,
                served_quantization_config(deployment.format),
                serving,
                Path(directory),
            )
            upstream, fixed = (
                build_rank(cls, text_config, deployment, serving, model_dir)
                for cls in (upstream_cls, fixed_cls)
            )
        except (AssertionError, TypeError, ValueError, RuntimeError) as error:
            raise PlanError(
                f"{VLLM} cannot build Kimi-K3 for {deployment.label()} in "
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
