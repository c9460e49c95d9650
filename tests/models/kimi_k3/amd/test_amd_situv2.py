"""Which activation AITER's SiTUv2 MoE kernel runs (vLLM's
``VLLM_ROCM_USE_AITER_MOE_SITUV2``: a4w4, its default, a8w4 or a16w4)
changes what no GPU allocates: on CDNA4 with AITER on, vLLM's MXFP4 method
selects the same backend for each, and the plugin the same rows. ``check``
says so where a server's environment sets an ``AITER_SITUV2_*`` variable
that vLLM replaces (``tools.check.aiter_environment``).

vLLM reads its variable once, into ``rocm_aiter_ops._MOE_SITUV2``; each
value is put there as vLLM would have read it.
"""

from __future__ import annotations

import pytest

from tests.models.kimi_k3.amd.conftest import AMD_GPUS, build_amd_kimi_moe
from tests.models.kimi_k3.amd.test_amd_partition import AITER, _layout
from tests.models.kimi_k3.builders import routed_experts
from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_platform import an_amd_gpu

ACTIVATIONS = ("a4w4", "a8w4", "a16w4")


@pytest.mark.parametrize(
    "topology", [Topology(32), Topology(8, dp_size=2)], ids=["TP32", "TP8xDP2"]
)
def test_every_situv2_activation_allocates_the_same(amd_model, topology) -> None:
    from vllm._aiter_ops import rocm_aiter_ops

    arch, aiter = AMD_GPUS["cdna4-aiter"]
    layouts = {}
    for activation in ACTIVATIONS:
        with replaced_attributes(rocm_aiter_ops, _MOE_SITUV2=activation):
            with an_amd_gpu(arch, aiter=aiter):  # the value is vLLM's there
                low_precision = rocm_aiter_ops.is_fused_moe_situv2_enabled()
                assert low_precision == (activation != "a16w4")
            moe = build_amd_kimi_moe(amd_model, "cdna4-aiter", topology)
        layouts[activation] = _layout(routed_experts(moe))
    assert layouts["a4w4"][1] == AITER
    assert layouts["a4w4"] == layouts["a8w4"] == layouts["a16w4"]
