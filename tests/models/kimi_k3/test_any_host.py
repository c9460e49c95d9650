"""``plan``, ``check`` and ``selftest`` answer for the serving nodes, whatever host
runs them: on a CUDA node of 8 GPUs (of an older GPU than the serving ones)
vLLM's config builds every layout a CPU box builds, TP32 included."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.models.kimi_k3.gpu_stand_ins import a_cuda_node
from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    Serving,
    Topology,
    layouts,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    rank_vllm_config,
    write_model_dir,
)
from vllm_kimi_k3_moe.tools.plan.planner import Planner

NODE_GPUS = 8
# A Turing GPU (T4, 7.5), below the minimum capability vLLM sets for MXFP4,
# ModelOpt and FP8 (8.0): a host that does not serve Kimi-K3 itself.
OLD_GPU = (7, 5)
SERVING_GPU = (9, 0)


@pytest.fixture(scope="module")
def model_dirs():
    """A weightless Kimi-K3 directory per published format."""
    with tempfile.TemporaryDirectory() as root:
        dirs = {}
        for fmt in FORMATS:
            directory = Path(root) / fmt.name
            directory.mkdir()
            dirs[fmt.name] = write_model_dir(
                KIMI_K3_TEXT_CONFIG,
                fmt.published_quantization_config(),
                Serving(),
                directory,
            )
        yield dirs


@pytest.mark.parametrize(
    ("host_gpus", "gpus", "nodes"),
    [
        (NODE_GPUS, 32, 4),  # TP32 and every other layout over four nodes
        (1, 8, 1),  # a one-GPU machine planning one node of eight
    ],
)
def test_every_layout_configures_on_a_smaller_cuda_host(
    kimi_model, model_dirs, host_gpus, gpus, nodes
):
    """vLLM's ``VllmConfig`` for each layout of ``gpus`` GPUs (TP32, TP16 x
    PP2, TP8 x DP4, ...) is made as on the serving nodes: the world size is
    not compared with this host's GPUs, the format not refused for its GPU."""
    found = layouts(gpus, KIMI_K3_TEXT_CONFIG)
    with a_cuda_node(host_gpus, OLD_GPU):
        for topology in found:
            config = rank_vllm_config(model_dirs["mxfp4"], topology, "marlin")
            assert config.parallel_config.nnodes == nodes
        # every format's minimum capability is a serving GPU's concern
        for fmt in FORMATS:
            rank_vllm_config(model_dirs[fmt.name], Topology(gpus), fmt.moe_backends[0])


def test_selftest_on_a_gpu_asks_the_gpu_it_runs_on(kimi_model, model_dirs):
    """selftest runs the kernel of the GPU it is on: its config takes that
    GPU's capability (vLLM refuses MXFP4 on one below 8.0), and TP32 still
    configures on an 8-GPU node."""
    with a_cuda_node(NODE_GPUS, SERVING_GPU):
        rank_vllm_config(model_dirs["mxfp4"], Topology(32), "marlin", device="cuda")
    with (
        a_cuda_node(NODE_GPUS, OLD_GPU),
        pytest.raises(ValueError, match="not supported for the current GPU"),
    ):
        rank_vllm_config(model_dirs["mxfp4"], Topology(32), "marlin", device="cuda")


def test_plan_and_the_advisor_on_an_8_gpu_node(kimi_k3_deployment_plans):
    """``plan --tp 32`` sizes TP32 on an 8-GPU CUDA node as on a CPU box, and
    the advisor for 32 GPUs lists every layout ``layouts`` finds, none refused."""
    budget = GpuBudget(gpu_preset("h20").memory_gib)
    with (
        a_cuda_node(NODE_GPUS, OLD_GPU),
        Planner(KIMI_K3_TEXT_CONFIG, budget=budget) as planner,
    ):
        plans, refused = planner.advise(32, "mxfp4", "marlin")
    assert refused == []
    assert len(plans) == len(layouts(32, KIMI_K3_TEXT_CONFIG)) > 100
    (tp32,) = [p for p in plans if p.deployment == Deployment(32)]
    on_cpu_box = kimi_k3_deployment_plans[32]
    assert tp32.fixed.components == on_cpu_box.fixed.components
    assert tp32.upstream.components == on_cpu_box.upstream.components
    assert tp32.fixed_kv == on_cpu_box.fixed_kv
