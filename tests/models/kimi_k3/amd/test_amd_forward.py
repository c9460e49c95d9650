"""On ROCm, every GPU's Kimi-K3 routed
experts, built by vLLM's AMD ``KimiMoE`` with the plugin and loaded by its
own ``load_weights``, add up to the unsharded experts at TP16, TP32, TP16 x
DP2 and with expert parallelism, with every byte nobody wrote random.

vLLM alone raises on all of these (``test_amd_partition``). Each GPU of the
split is built as on an MI300X (``on_an_amd_gpu``), loaded from a small
synthetic MXFP4 checkpoint through vLLM's loader (the AMD model's
``KimiLinearModel.load_weights`` and its VL wrapper's name mapper), routed
by its own router and run through vLLM's CPU reference MoE kernel on its
loaded weights as vLLM dequantizes them (the selftest's harness); the sum
over GPUs is what the all-reduce computes. The emulation experts' weight
preparation leaves the loaded tensors as they are (``oracle/mxfp4.py``,
``EMULATION``), so these are the tensors its forward dequantizes. On CDNA4
vLLM selects AITER's MXFP4 kernel, which cannot run on a CPU (nor its weight
shuffle): there the same sum over its loaded layout (128-row partitions,
their pads never written) shows every row right and every pad zero; what
AITER's Python reads of the layout is held in ``test_amd_partition``.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import AbstractContextManager
from typing import Any

import pytest

from tests.models.kimi_k3.amd.conftest import on_an_amd_gpu
from tests.models.kimi_k3.forward_cases import SMALL, TOLERANCE, layer_cache
from tests.models.kimi_k3.gpu_stand_ins import random_uninitialised_memory
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Topology
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_platform import aiter_off
from vllm_kimi_k3_moe.tools.selftest.harness import (
    SelftestCase,
    deployment_outputs,
    errors_of,
)
from vllm_kimi_k3_moe.tools.selftest.kernels import RankKernel, ReferenceKernel

pytestmark = [
    pytest.mark.forward_equivalence,
    pytest.mark.usefixtures("one_cpu_thread"),
]

# 16 experts, so that expert parallelism over 16 GPUs gives each one
SIXTEEN_EXPERTS = {**SMALL, "num_experts": 16}
# The GPU (``AMD_GPUS``) and the backend vLLM selects there. Emulation's rows
# are whole 32s (no pad at these splits); AITER's 128s pad 192 and 96 rows:
# its pads, never written, must be zero for the sum to hold.
GPUS = [("cdna3", "EMULATION"), ("cdna4-aiter", "AITER_MXFP4_BF16")]
CASES = [
    Topology(16),  # 192 rows a GPU (emulation rounds to 32s)
    Topology(32),  # 96
    Topology(16, dp_size=2),  # every expert over 32 GPUs: 96
    Topology(16, expert_parallel=True),  # whole 3072-row experts
]


class OnAnAmdGpu(ReferenceKernel):
    """vLLM's CPU reference kernel on each GPU's loaded weights, the GPU
    built and loaded as on the AMD GPU ``gpu`` names (``AMD_GPUS``)."""

    def __init__(self, gpu: str) -> None:
        super().__init__()
        self.gpu = gpu

    def selection(self, deployment: Deployment) -> AbstractContextManager[Any]:
        return on_an_amd_gpu(self.gpu)

    def prepare(self, model: Any, fmt: str, vllm_config: Any) -> RankKernel:
        """The reference forward, routed by vLLM's own router without
        AITER's routing kernel (a GPU kernel, not the layout under test)."""
        kernel = super().prepare(model, fmt, vllm_config)

        def forward(*args: Any) -> Any:
            with aiter_off():
                return kernel.forward(*args)

        return dataclasses.replace(kernel, forward=forward)


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """A written layer for the GPUs that split every expert, and one for
    those that hold whole experts (as many experts as GPUs)."""
    return {
        ep: layer_cache(lambda name: tmp_path_factory.mktemp(f"kimi-k3-amd-{name}"))
        for ep in (False, True)
    }


@pytest.mark.parametrize(("gpu", "backend"), GPUS)
@pytest.mark.parametrize("topology", CASES, ids=lambda t: t.label().replace(" ", ""))
def test_every_gpu_sums_to_the_unsharded_experts(
    amd_model, layers, topology, gpu, backend
):
    case = SelftestCase("mxfp4", topology, "auto", text_config=SIXTEEN_EXPERTS)
    layer = layers[topology.expert_parallel]
    partitions = {}

    def record(rank: Any, loaded: Any) -> None:
        config = loaded.experts.moe_config
        partitions[rank] = (
            loaded.experts.quant_method.mxfp4_backend.value,
            config.intermediate_size_per_partition,
        )

    outputs = deployment_outputs(
        OnAnAmdGpu(gpu),
        case,
        amd_model,
        layer(case),
        building=lambda: random_uninitialised_memory(seed=51),
        on_rank=record,
    )
    errors = errors_of(outputs, layer(case))
    assert all(math.isfinite(e) and e < TOLERANCE for e in errors.values()), errors
    backends = {backend for backend, _ in partitions.values()}
    assert backends == {backend}
    assert len(partitions) == topology.tp_size * topology.dp_size
