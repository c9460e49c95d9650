"""Real vLLM 0.33.0 Kimi-K3 MoE layers on a CPU-only box.

Everything under test is vLLM's own code with the plugin registered. The
stand-ins, each for something a CPU test box does not have, are entered by the
fixtures in this file (``rank_config``, ``decoder_layer_on_cpu``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from types import ModuleType

import pytest
import torch
from torch import nn

import vllm_kimi_k3_moe
from tests.models.kimi_k3 import kimi_k3_shapes as k3
from vllm_kimi_k3_moe.kimi_k3_text_config import (
    kimi_k3_text_config as kimi_k3_moe_config,
)
from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import upstream_kimi_moe
from vllm_kimi_k3_moe.simulated_rank import (
    QUANTIZATION_PATHS,
    Topology,
    build_kimi_moe_layer,
    marlin_without_gpu,
    rank_vllm_config,
    simulated_rank,
)

KIMI_K3_NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"

# Native MXFP4 (the released checkpoint, rewritten by vLLM) and the
# compressed-tensors MXFP4 method (other compressed-tensors formats).
on_both_quantization_paths = pytest.mark.parametrize("quantization", QUANTIZATION_PATHS)


@pytest.fixture(scope="session")
def kimi_model() -> ModuleType:
    """vLLM's Kimi-K3 NVIDIA model module, imported once (~25-50 s), patched."""
    vllm_kimi_k3_moe.register()
    return importlib.import_module(KIMI_K3_NVIDIA_MODEL)


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


@pytest.fixture
def rank_config() -> Iterator[Callable[..., object]]:
    """Pose as one rank of a topology and return its MXFP4 Marlin
    ``VllmConfig`` (native MXFP4 unless ``quantization="compressed-tensors"``).
    The stand-ins (``vllm_kimi_k3_moe.simulated_rank``) cover what a CPU box
    lacks: torch.distributed groups (layers read their size and rank) and a
    CUDA device for vLLM's Marlin device check (the tests pick Marlin as
    ``--moe-backend marlin`` does). Undone after each test."""
    with ExitStack() as stack:
        stack.enter_context(marlin_without_gpu())

        def make(topology: Topology, quantization: str = "mxfp4") -> object:
            stack.enter_context(simulated_rank(topology))
            return rank_vllm_config(topology, quantization)

        yield make


@pytest.fixture
def build_kimi_moe(
    kimi_model: ModuleType, rank_config: Callable[..., object]
) -> Callable[..., nn.Module]:
    """Build one real ``KimiMoE`` (patched unless ``upstream=True``) as one rank."""

    def build(
        topology: Topology,
        *,
        upstream: bool = False,
        small: bool = False,
        device: str = "meta",
        quantization: str = "mxfp4",
    ) -> nn.Module:
        cls = upstream_kimi_moe(kimi_model) if upstream else kimi_model.KimiMoE
        return build_kimi_moe_layer(
            cls,
            kimi_k3_text_config(small=small),
            rank_config(topology, quantization),
            device,
        )

    return build


def routed_experts(moe: nn.Module) -> nn.Module:
    """The ``RoutedExperts`` that owns the expert parameters of a ``KimiMoE``."""
    return moe.experts.routed_experts


class AttentionStandIn(nn.Module):
    """Replaces ``MultiHeadLatentAttention`` in decoder-layer tests: vLLM picks
    an attention backend for the current platform at construction, and the
    unspecified CPU platform has none. The MoE half of the layer is real."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


class CudaStreamStandIn:
    """Replaces ``torch.cuda.Stream`` where a layer creates one at construction
    (the MTP block): a CPU box has no CUDA streams."""


@pytest.fixture
def decoder_layer_on_cpu(
    kimi_model: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kimi_model, "MultiHeadLatentAttention", AttentionStandIn)
    monkeypatch.setattr(torch.cuda, "Stream", CudaStreamStandIn)
