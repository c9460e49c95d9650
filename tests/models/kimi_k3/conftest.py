"""Real vLLM 0.33.0 Kimi-K3 MoE layers on a CPU-only box.

Everything under test is vLLM's own code with the plugin registered. The only
stand-ins are in this file, each for something a CPU test box does not have.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from torch import nn

import vllm_kimi_k3_moe
from tests.models.kimi_k3 import kimi_k3_shapes as k3
from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import upstream_kimi_moe

KIMI_K3_NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"


@pytest.fixture(scope="session")
def kimi_model() -> ModuleType:
    """vLLM's Kimi-K3 NVIDIA model module, imported once (~25-50 s), patched."""
    vllm_kimi_k3_moe.register()
    return importlib.import_module(KIMI_K3_NVIDIA_MODEL)


def kimi_k3_text_config(*, small: bool = False):
    """Kimi-K3's text config; ``small`` keeps 3072 but shrinks widths/experts."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    return KimiLinearConfig(
        hidden_size=k3.SMALL_HIDDEN_SIZE if small else k3.HIDDEN_SIZE,
        routed_expert_hidden_size=(
            k3.SMALL_ROUTED_EXPERT_HIDDEN_SIZE
            if small
            else k3.ROUTED_EXPERT_HIDDEN_SIZE
        ),
        moe_intermediate_size=k3.MOE_INTERMEDIATE_SIZE,
        num_experts=k3.SMALL_NUM_EXPERTS if small else k3.NUM_EXPERTS,
        num_experts_per_token=(
            k3.SMALL_NUM_EXPERTS_PER_TOKEN if small else k3.NUM_EXPERTS_PER_TOKEN
        ),
        num_shared_experts=k3.NUM_SHARED_EXPERTS,
        hidden_act="situ",
        activation_situ_beta=1.0,
        activation_situ_linear_beta=0.0,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        moe_router_activation_func="sigmoid",
        routed_scaling_factor=2.5,
    )


@dataclass(frozen=True)
class FakeGroup:
    """Stands in for a ``GroupCoordinator``: a CPU test box has no
    torch.distributed process groups, and building a layer only reads the
    group's size and this process's rank in it."""

    world_size: int
    rank_in_group: int


@pytest.fixture
def parallel_groups(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Pose as one rank of a TP (x DP) deployment, with or without EP."""
    from vllm.distributed import parallel_state

    def pose(
        tp_size: int,
        tp_rank: int = 0,
        *,
        dp_size: int = 1,
        dp_rank: int = 0,
        expert_parallel: bool = False,
    ) -> None:
        monkeypatch.setattr(parallel_state, "_TP", FakeGroup(tp_size, tp_rank))
        monkeypatch.setattr(parallel_state, "_DP", FakeGroup(dp_size, dp_rank))
        monkeypatch.setattr(parallel_state, "_PCP", FakeGroup(1, 0))
        monkeypatch.setattr(parallel_state, "_PP", FakeGroup(1, 0))
        ep_size = tp_size * dp_size if expert_parallel else 1
        ep_rank = dp_rank * tp_size + tp_rank if expert_parallel else 0
        monkeypatch.setattr(parallel_state, "_EP", FakeGroup(ep_size, ep_rank))

    return pose


@pytest.fixture
def marlin_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's device check for the Marlin MoE kernel asks for a CUDA GPU, which
    a CPU box lacks; the tests choose Marlin explicitly, as
    ``--moe-backend marlin`` does on the GPUs it was reported on."""
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe

    monkeypatch.setattr(
        marlin_moe.MarlinExpertsBase, "_supports_current_device", lambda: True
    )


@dataclass(frozen=True)
class Topology:
    tp_size: int
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False


@pytest.fixture
def rank_config(
    parallel_groups: Callable[..., None], marlin_on_cpu: None
) -> Callable[[Topology], object]:
    """Pose as one rank of ``topology``; return its native-MXFP4 Marlin
    ``VllmConfig`` (a fresh one per layer: vLLM refuses duplicate layer names)."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

    def make(topology: Topology) -> VllmConfig:
        parallel_groups(
            topology.tp_size,
            topology.tp_rank,
            dp_size=topology.dp_size,
            dp_rank=topology.dp_rank,
            expert_parallel=topology.expert_parallel,
        )
        vllm_config = VllmConfig(
            device_config=DeviceConfig(device="cpu"), quant_config=Mxfp4Config()
        )
        vllm_config.kernel_config.moe_backend = "marlin"
        parallel = vllm_config.parallel_config
        parallel.tensor_parallel_size = topology.tp_size
        parallel.data_parallel_size = topology.dp_size
        parallel.enable_expert_parallel = topology.expert_parallel
        return vllm_config

    return make


@pytest.fixture
def build_kimi_moe(
    kimi_model: ModuleType, rank_config: Callable[[Topology], object]
) -> Callable[..., nn.Module]:
    """Build one real ``KimiMoE`` (patched unless ``upstream=True``) as one rank."""
    from vllm.config import set_current_vllm_config

    def build(
        topology: Topology,
        *,
        upstream: bool = False,
        small: bool = False,
        device: str = "meta",
    ) -> nn.Module:
        vllm_config = rank_config(topology)
        cls = upstream_kimi_moe(kimi_model) if upstream else kimi_model.KimiMoE
        with set_current_vllm_config(vllm_config), torch.device(device):
            return cls(
                kimi_k3_text_config(small=small),
                vllm_config,
                quant_config=vllm_config.quant_config,
                prefix="model.layers.1.block_sparse_moe",
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
