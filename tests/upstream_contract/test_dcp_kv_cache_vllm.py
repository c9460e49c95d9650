"""Decode context parallelism as vLLM 0.33.0 builds and sizes Kimi-K3: a rank
built with ``--decode-context-parallel-size`` holds the same parameters and
reports the same KV-cache specs as without it (so the planner builds each
TP once and sizes every DCP size from it), and the KV tokens the planner
gives a DCP layout are what vLLM's planner makes of that real DCP build."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.kv_cache import KvCachePlanner
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank

# TP32 fits H20s with the plugin: DCP32 spreads each request's MLA tokens
# over all 32 GPUs of the TP group.
DCP = Deployment(32, dcp_size=32)


@pytest.fixture(scope="module")
def dcp_build(kimi_k3_h20_planner):
    """The plugin's rank 0 of TP32 DCP32, built with DCP (vLLM's MLA sets up
    its DCP manager), on the meta device."""
    with tempfile.TemporaryDirectory() as directory:
        model_dir = write_model_dir(
            KIMI_K3_TEXT_CONFIG,
            mxfp4.RELEASE.published_quantization_config(),
            Serving(),
            Path(directory),
        )
        return build_rank(
            kimi_k3_h20_planner.fixed_cls,
            KIMI_K3_TEXT_CONFIG,
            DCP,
            Serving(),
            model_dir,
        )


def test_the_build_has_dcp_and_no_other_parameter(kimi_k3_h20_planner, dcp_build):
    mla = dcp_build.model.language_model.model.layers[3].self_attn
    assert mla.dcp_world_size == 32 and mla.dcp_manager is not None
    (stage,) = kimi_k3_h20_planner.plan(DCP).stages
    # the planner sized TP32's build (no DCP); the DCP build allocates the same
    assert dcp_build.allocation.components == stage.fixed.components


def test_kv_tokens_are_what_vllm_makes_of_the_dcp_build(kimi_k3_h20_planner, dcp_build):
    """vLLM's planner, given the DCP build's own ``VllmConfig`` and the specs
    its layers report, allocates the tokens the planner gives TP32 DCP32,
    at the memory the planner left for them."""
    plan = kimi_k3_h20_planner.plan(DCP)
    real = KvCachePlanner(dcp_build.vllm_config)
    assert real.shape == plan.kv_cache
    assert real.shape.dcp_size == 32
    assert real.capacity([plan.fixed_kv.available_bytes]) == plan.fixed_kv
    assert (
        plan.fixed_kv.tokens > kimi_k3_h20_planner.plan(Deployment(32)).fixed_kv.tokens
    )
