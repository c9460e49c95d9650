"""The GPU memory ``plan`` gives the KV cache is what the installed vLLM
leaves it: the sizing, utilization and share vLLM resolves for the serving
GPUs (0.33: its start-up profile within 0.92; 0.34: its extensible KV
cache, measured after warmup, within all of the GPU), the CUDA context
taken out of the KV cache only where vLLM sizes it after warmup, and the
KV bytes vLLM's own measurement gives for a GPU holding the weights."""

from __future__ import annotations

import copy

import pytest

from tests.models.kimi_k3.kimi_k3_formats import release_model_dir
from vllm_kimi_k3_moe import compat
from vllm_kimi_k3_moe.tools.deployment import kv_budget as kv_budget_module
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import (
    ACTIVATIONS_GIB,
    CONTEXT_GIB,
    GIB,
    BudgetError,
    GpuBudget,
)
from vllm_kimi_k3_moe.tools.deployment.kv_budget import kv_budget
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config
from vllm_kimi_k3_moe.tools.plan.serve_command import serve_commands

H200_GIB = 141
# TP32's weights per GPU on an H200 (plan's table): with the plugin, and
# vLLM alone's, which leaves less than the reserve
WEIGHTS = (75_900_000_000, 136_100_000_000)


@pytest.fixture(scope="module")
def cache_config(kimi_model):
    """vLLM's ``CacheConfig`` for TP32 serving Kimi-K3, as the tools make it
    for the serving GPUs."""
    return rank_vllm_config(release_model_dir(), Topology(32), "marlin").cache_config


def after_warmup(cache_config) -> bool:
    return compat.kv_cache_sizing_after_warmup(cache_config) is not None


def test_the_kv_cache_is_sized_as_on_cuda(cache_config):
    """Every vLLM that has the extensible KV cache turns it on for CUDA GPUs
    (vLLM 0.34's default), though the tools run on a CPU box: plan then
    sizes after warmup; vLLM 0.33 sizes from its profile."""
    assert after_warmup(cache_config) == (
        compat.extensible_kv_cache_resolver() is not None
    )
    assert kv_budget(GpuBudget(H200_GIB), cache_config).after_warmup == (
        after_warmup(cache_config)
    )


def test_the_context_comes_out_of_the_kv_cache_only_after_warmup(
    cache_config, monkeypatch
):
    """A GiB more of CUDA context and NCCL buffers is a GiB less KV cache
    where vLLM sizes it after warmup (0.34), and no change where it sizes
    it from its profile within its share (0.33: the context sits in the
    rest of the GPU)."""
    weights = WEIGHTS[0]
    before = kv_budget(GpuBudget(H200_GIB), cache_config).kv_cache_bytes(weights)
    monkeypatch.setattr(kv_budget_module, "CONTEXT_GIB", CONTEXT_GIB + 1)
    after = kv_budget(GpuBudget(H200_GIB), cache_config).kv_cache_bytes(weights)
    assert before - after == (GIB if after_warmup(cache_config) else 0)


@pytest.mark.parametrize("utilization", [None, 0.92])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_after_warmup_it_is_vllms_measurement(cache_config, utilization, weights):
    """The KV cache plan gives next to the weights is what vLLM's
    ``measure_kv_cache_bytes`` gives a GPU that, after warmup, holds the
    weights beside the CUDA context, with the activation estimate as its
    transient peak (vLLM's own call, weights in; plan subtracts them from
    a reserve made without them)."""
    if not after_warmup(cache_config):
        pytest.skip(f"{compat.VLLM} sizes the KV cache from its profile")
    sizing = compat.kv_cache_sizing_after_warmup(cache_config)
    budget = kv_budget(GpuBudget(H200_GIB, utilization), cache_config)
    total = GpuBudget(H200_GIB).total_bytes
    context = round(CONTEXT_GIB * GIB)
    measured = sizing.measure_kv_cache_bytes(
        init_free_memory=total - context,
        free_memory=total - context - weights,
        committed_bytes=0,
        requested_memory=budget.requested_bytes,
        transient_peak_bytes=round(ACTIVATIONS_GIB * GIB),
    )
    assert max(budget.kv_cache_bytes(weights), 0) == measured
    if utilization is None:  # all of the GPU: the context and margin come out
        floor = context + round(ACTIVATIONS_GIB * GIB)
        assert budget.reserve_bytes >= floor + sizing.KV_CACHE_MARGIN_FLOOR_BYTES
        # what vLLM keeps outside torch is part of that margin
        assert sizing.KV_CACHE_NON_TORCH_RESERVE_BYTES < (
            sizing.KV_CACHE_MARGIN_FLOOR_BYTES
        )


def test_a_share_the_context_does_not_leave(cache_config):
    """Sizing from its profile vLLM refuses to start where the CUDA context
    leaves less free than its share (``request_memory``); after warmup the
    share is only a cap and all of the GPU is taken."""
    profile = copy.copy(cache_config)
    if after_warmup(cache_config):
        profile.enable_extensible_kv_cache = False
        whole = kv_budget(GpuBudget(H200_GIB, utilization=1.0), cache_config)
        assert whole.requested_bytes == GpuBudget(H200_GIB).total_bytes
    with pytest.raises(BudgetError, match="less than desired GPU memory"):
        kv_budget(GpuBudget(H200_GIB, utilization=1.0), profile)
    assert kv_budget(GpuBudget(H200_GIB), profile).utilization < 1


def test_a_reserve_given_is_taken_as_given(cache_config):
    """--reserve-gib is what of vLLM's share neither the weights nor the KV
    cache get, on either sizing (a start-up log's figure)."""
    budget = kv_budget(GpuBudget(H200_GIB, reserve_gib=4.5), cache_config)
    assert budget.reserve_given and budget.reserve_bytes == round(4.5 * GIB)
    assert budget.kv_cache_bytes(WEIGHTS[0]) == (
        budget.requested_bytes - WEIGHTS[0] - round(4.5 * GIB)
    )


@pytest.mark.parametrize(("utilization", "flag"), [(None, []), (0.9, ["0.9"])])
def test_serve_lines_pin_the_utilization_only_where_given(utilization, flag):
    """Unset, vLLM resolves its own default, which plan sized with (and with
    its extensible KV cache vLLM advises leaving it unset)."""
    (line,) = serve_commands(Deployment(8), Serving(), GpuBudget(H200_GIB, utilization))
    words = line.split()
    pinned = [
        words[i + 1] for i, w in enumerate(words) if w == "--gpu-memory-utilization"
    ]
    assert pinned == flag
