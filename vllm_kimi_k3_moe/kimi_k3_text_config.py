"""Kimi-K3's public text-model dimensions, as a vLLM ``KimiLinearConfig``.

Kimi-K3's ``config.json`` nests the language model under ``text_config``; these
are the MoE-relevant values from it (hidden 7168, latent MoE width 3584,
``moe_intermediate_size`` 3072, 896 routed + 2 shared experts, top-16, SiTU
activation, sigmoid grouped top-k routing with one group).
"""

from __future__ import annotations

from typing import Any

KIMI_K3_MOE_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 7168,
    "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 3072,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "hidden_act": "situ",
    "activation_situ_beta": 1.0,
    "activation_situ_linear_beta": 0.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.5,
}

NUM_MOE_LAYERS = 92  # of 93 layers


def kimi_k3_text_config(**overrides: Any) -> Any:
    """A ``KimiLinearConfig`` with Kimi-K3's MoE dimensions (and ``overrides``)."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    return KimiLinearConfig(**{**KIMI_K3_MOE_TEXT_CONFIG, **overrides})
