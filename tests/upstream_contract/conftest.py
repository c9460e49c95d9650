"""The Kimi-K3 fixtures these tests share with ``tests/models/kimi_k3``: vLLM's
Kimi-K3 NVIDIA model module (imported once, plugin registered), the tests'
builds of its MoE layer, and the module tree of its MoE layers only, for
loading a checkpoint."""

from tests.models.kimi_k3.conftest import (  # noqa: F401 (fixtures)
    build_kimi_moe,
    format_experts,
    kimi_k3_h20_planner,
    kimi_k3_planner,
    kimi_model,
    moe_layers_only_model,
    one_cpu_thread,
    rank_config,
)
