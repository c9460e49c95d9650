"""Real vLLM 0.33.0 Kimi-K3 MoE layers on a CPU-only box.

Everything under test is vLLM's own code with the plugin registered. The
stand-ins (``gpu_stand_ins``), each for something a CPU test box does not
have, are entered by the fixtures in this file (``rank_config``,
``format_experts``, ``decoder_layer_on_cpu``); what the tests build from is in
``builders``.
"""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from types import ModuleType

import pytest
import torch
from torch import nn

import vllm_kimi_k3_moe
from tests.models.kimi_k3.builders import (
    POISON,
    build_kimi_moe_layer,
    kimi_k3_text_config,
    routed_experts,
)
from tests.models.kimi_k3.gpu_stand_ins import (
    AttentionStandIn,
    marlin_without_gpu,
    uninitialised_memory_reads,
)
from tests.models.kimi_k3.kimi_k3_formats import format_model_dir, format_vllm_config
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import first_layer
from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank, simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    CudaStreamStandIn,
    moe_kernels_on_their_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config
from vllm_kimi_k3_moe.tools.selftest.layer import build_moe_layers
from vllm_kimi_k3_moe.verification import verdict


@pytest.fixture(scope="session")
def kimi_model() -> ModuleType:
    """vLLM's Kimi-K3 NVIDIA model module, imported once (~25-50 s), patched."""
    vllm_kimi_k3_moe.register()
    return importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)


@pytest.fixture(scope="session")
def kimi_k3_planner(kimi_model: ModuleType) -> Iterator[object]:
    """A ``Planner`` of Kimi-K3's published config at vLLM's defaults, no
    GPU budget, made once a session: the tests that plan on it, or on
    ``sized_for`` it, share its builds (each sharding is built once)."""
    from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
    from vllm_kimi_k3_moe.tools.plan.planner import Planner

    with Planner(KIMI_K3_TEXT_CONFIG) as planner:
        yield planner


def sized_for(planner: object, budget: object) -> object:
    """``planner`` sizing the KV cache for GPUs of ``budget`` (a
    ``GpuBudget``), on the same builds: what a deployment's rank 0
    allocates reads no budget (``Planner._build``), only the KV-cache
    sizing of a plan does. Closed with ``planner``."""
    other = copy.copy(planner)
    other.budget = budget
    return other


@pytest.fixture(scope="session")
def kimi_k3_plan(kimi_k3_planner: object) -> Callable[..., object]:
    """``plan(deployment, budget=None)``: ``deployment`` sized as
    ``plan_deployment`` sizes it with Kimi-K3's published config (a
    ``Planner`` of its own), on ``kimi_k3_planner``'s builds."""
    planners = {None: kimi_k3_planner}

    def plan(deployment: object, budget: object = None) -> object:
        if budget not in planners:
            planners[budget] = sized_for(kimi_k3_planner, budget)
        return planners[budget].plan(deployment)

    return plan


@pytest.fixture(scope="session")
def kimi_k3_h20_planner(kimi_k3_planner: object) -> object:
    """A ``Planner`` of Kimi-K3's published config on H20s (``--gpu h20``;
    vLLM's defaults otherwise): the tests that plan on it share its builds
    (``kimi_k3_planner``'s)."""
    from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
    from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset

    return sized_for(kimi_k3_planner, GpuBudget(gpu_preset("h20").memory_gib))


@pytest.fixture(scope="session")
def kimi_k3_deployment_plans(kimi_k3_h20_planner) -> dict[int, object]:
    """The plans of Kimi-K3's published config, released MXFP4 on Marlin,
    at TP8, TP16 and TP32, on H20s: read by several test files."""
    from vllm_kimi_k3_moe.tools.deployment.topology import Deployment

    return {tp: kimi_k3_h20_planner.plan(Deployment(tp)) for tp in (8, 16, 32)}


@pytest.fixture
def fresh_registration(kimi_model, monkeypatch, caplog):
    """The plugin unregistered (patches reverted, hooks removed, warnings
    forgotten), its warnings captured; registered again afterwards."""
    vllm_kimi_k3_moe.unregister()
    # Whether vLLM's logger propagates to caplog's root handler depends on
    # vLLM's logging setup: listen on the plugin's logger itself, once.
    monkeypatch.setattr(vllm_kimi_k3_moe.logger, "handlers", [caplog.handler])
    monkeypatch.setattr(vllm_kimi_k3_moe.logger, "propagate", False)
    caplog.set_level(logging.WARNING, logger=vllm_kimi_k3_moe.logger.name)
    yield caplog
    monkeypatch.undo()  # the test's version or platform first
    vllm_kimi_k3_moe.unregister()
    vllm_kimi_k3_moe.register()


@pytest.fixture
def unverified_code(kimi_model, fresh_registration, monkeypatch) -> object:
    """The plugin registered on code it was not verified on: every recorded
    digest another, signatures as recorded."""
    other = {
        release: {patch: {**code, "digest": "0" * 16} for patch, code in fixes.items()}
        for release, fixes in verdict.VERIFIED_CODE.items()
    }
    monkeypatch.setattr(verdict, "VERIFIED_CODE", other)
    fresh_registration.set_level(logging.INFO, logger=vllm_kimi_k3_moe.logger.name)
    vllm_kimi_k3_moe.register()
    assert first_layer.owed()
    return fresh_registration


@pytest.fixture
def rank_config() -> Iterator[Callable[..., object]]:
    """Pose as one rank of a topology and return its MXFP4 Marlin
    ``VllmConfig`` (native MXFP4 unless ``quantization="ct-mxfp4"``; given a
    checkpoint's directory ``model_dir``, vLLM's own resolution of it).
    The stand-ins (``simulated_rank``, ``gpu_stand_ins.marlin_without_gpu``)
    cover what a CPU box lacks: torch.distributed groups (layers read their
    size and rank) and a CUDA device for vLLM's Marlin device check (the
    tests pick Marlin as ``--moe-backend marlin`` does). Undone after each
    test."""
    with ExitStack() as stack:
        stack.enter_context(marlin_without_gpu())

        def make(
            rank: Rank | Topology, quantization: str = "mxfp4", model_dir=None
        ) -> object:
            stack.enter_context(simulated_rank(rank))
            topology = rank.topology if isinstance(rank, Rank) else rank
            directory = model_dir or format_model_dir(quantization)
            return rank_vllm_config(directory, topology, "marlin")

        yield make


@pytest.fixture
def build_kimi_moe(
    kimi_model: ModuleType, rank_config: Callable[..., object]
) -> Callable[..., nn.Module]:
    """Build one real ``KimiMoE`` (patched unless ``upstream=True``) as one rank."""

    def build(
        topology: Rank | Topology,
        *,
        upstream: bool = False,
        small: bool = False,
        device: str = "meta",
        quantization: str = "mxfp4",
    ) -> nn.Module:
        cls = upstream_class(kimi_model.KimiMoE) if upstream else kimi_model.KimiMoE
        return build_kimi_moe_layer(
            cls,
            kimi_k3_text_config(small=small),
            rank_config(topology, quantization),
            device,
        )

    return build


@pytest.fixture
def uninitialised_memory_is_visible() -> Iterator[None]:
    """A CPU often hands ``torch.empty`` freshly zeroed pages, which would hide
    a missing zero-fill. Here uninitialised CPU memory reads as 0xA5 bytes,
    whatever the dtype."""
    with uninitialised_memory_reads(POISON):
        yield


@pytest.fixture
def format_experts(kimi_model: ModuleType) -> Callable[..., nn.Module]:
    """Rank ``topology``'s routed experts of a real ``KimiMoE`` (patched unless
    ``upstream=True``) serving Kimi-K3 in checkpoint format ``fmt``
    (``kimi_k3_formats``) with ``--moe-backend backend``. vLLM's own backend
    selection decides, with every kernel's device check answering as on its
    GPU (``moe_kernels_on_their_gpu``). ``min_partition`` sets vLLM alone's
    model-level minimum rows per rank (``min_moe_intermediate_per_partition``)."""

    def build(
        fmt: str,
        backend: str,
        topology: Rank | Topology,
        *,
        upstream: bool = False,
        small: bool = False,
        device: str = "meta",
        min_partition: int | None = None,
        prefix: str = "model.layers.1.block_sparse_moe",
    ) -> nn.Module:
        cls = upstream_class(kimi_model.KimiMoE) if upstream else kimi_model.KimiMoE
        config = kimi_k3_text_config(small=small)
        if min_partition is not None:
            config.min_moe_intermediate_per_partition = min_partition
        with simulated_rank(topology), moe_kernels_on_their_gpu():
            moe = build_kimi_moe_layer(
                cls, config, format_vllm_config(topology, fmt, backend), device, prefix
            )
        return routed_experts(moe)

    return build


@pytest.fixture
def decoder_layer_on_cpu(
    kimi_model: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kimi_model, "MultiHeadLatentAttention", AttentionStandIn)
    monkeypatch.setattr(torch.cuda, "Stream", CudaStreamStandIn)


@pytest.fixture
def one_cpu_thread() -> Iterator[None]:
    """Run torch on one thread: at the forward tests' tiny shapes, on a small
    machine shared with other work, two OpenMP threads waiting on each other
    make loading and the forward several times slower. Results are checked
    to a tolerance, and bit-for-bit comparisons run under the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def moe_layers_only_model(kimi_model: ModuleType) -> Callable[..., nn.Module]:
    """Build Kimi-K3's module tree with only its MoE layers, for loading a
    checkpoint. Stands in for ``KimiK3ForConditionalGeneration``, whose
    attention, KDA and vision tower pick kernels for the current platform at
    construction, which a CPU box lacks. What is real: every ``KimiMoE`` (at
    ``language_model.model.layers.N.block_sparse_moe``, built as
    ``KimiDecoderLayer`` builds it) and ``KimiLinearModel.load_weights``, with
    its Kimi-K3 expert name mapping, reached through vLLM's
    ``AutoWeightsLoader`` with ``KimiK3ForConditionalGeneration``'s mapper.
    The selftest's own build (``selftest.layer.build_moe_layers``), on the
    CPU."""

    def build(vllm_config: object, kimi_moe_cls: type) -> nn.Module:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(vllm_config):
            return build_moe_layers(kimi_model, kimi_moe_cls, vllm_config, "cpu")

    return build
