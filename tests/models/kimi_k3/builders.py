"""What the Kimi-K3 tests build from: the model's text config, the two MXFP4
quantization paths, the poison byte and a built layer's routed experts."""

from __future__ import annotations

import pytest
from torch import nn

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from vllm_kimi_k3_moe.tools.text_config import (
    kimi_k3_text_config as kimi_k3_moe_config,
)
from vllm_kimi_k3_moe.tools.topology import MXFP4_PATHS

POISON = 0xA5  # the byte uninitialised memory reads as in these tests

# Native MXFP4 (the released checkpoint, rewritten by vLLM) and the
# compressed-tensors MXFP4 method (other compressed-tensors formats).
on_both_quantization_paths = pytest.mark.parametrize("quantization", MXFP4_PATHS)


def kimi_k3_text_config(*, small: bool = False):
    """Kimi-K3's text config; ``small`` keeps 3072 but shrinks widths/experts."""
    if not small:
        return kimi_k3_moe_config()
    return kimi_k3_moe_config(
        hidden_size=k3.SMALL_HIDDEN_SIZE,
        routed_expert_hidden_size=k3.SMALL_ROUTED_EXPERT_HIDDEN_SIZE,
        num_experts=k3.SMALL_NUM_EXPERTS,
        num_experts_per_token=k3.SMALL_NUM_EXPERTS_PER_TOKEN,
    )


def routed_experts(moe: nn.Module) -> nn.Module:
    """The ``RoutedExperts`` that owns the expert parameters of a ``KimiMoE``."""
    return moe.experts.routed_experts
