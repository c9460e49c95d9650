"""On vLLM code the plugin was not verified on, the first AMD Kimi-K3 layer
proves the fixes on a small copy of itself, as the NVIDIA one does
(``fused_moe.proof.small_layer``), then gets its backend's rows; the AMD model's
fix is judged by its own targets (``amd/linear.py``'s ``KimiMoE.__init__``).
"""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest

import vllm_kimi_k3_moe
from tests.models.kimi_k3.amd.conftest import build_amd_kimi_moe
from tests.models.kimi_k3.builders import routed_experts
from tests.models.kimi_k3.test_small_layer_proof import plugin_lines
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import first_layer
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.verification import verdict

AMD_FIX = vllm_kimi_k3_moe.MODEL_PATCHES[vllm_kimi_k3_moe.KIMI_K3_AMD_LINEAR]


def test_the_amd_fix_is_verified_by_its_own_code(amd_model):
    (judged,) = verdict.judge_all([AMD_FIX])
    assert judged.state == verdict.VERIFIED
    assert AMD_FIX in vllm_kimi_k3_moe._decided[0]


# GPU, rows at TP32: emulation's 32s, AITER's 128s
@pytest.mark.parametrize(("gpu", "rows"), [("cdna3", 96), ("cdna4-aiter", 128)])
def test_the_first_amd_layer_proves_the_fixes(amd_model, unverified_code, gpu, rows):
    layer = routed_experts(build_amd_kimi_moe(amd_model, gpu, Topology(32)))

    (record,) = plugin_lines(unverified_code)
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "proven on a small layer of this deployment (Mxfp4MoEMethod, " in message
    assert "32 GPUs x 2 experts" in message
    assert not first_layer.owed()
    assert AMD_FIX in vllm_kimi_k3_moe._decided[0]
    assert layer.moe_config.intermediate_size_per_partition == rows


def test_doctor_judges_the_amd_model_on_rocm(amd_model):
    """``doctor``'s verdicts (``verification.report``) are those of the model
    the platform builds: on ROCm the AMD model's fix with the shared ones."""
    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_platform import an_amd_gpu
    from vllm_kimi_k3_moe.verification import report

    with an_amd_gpu():
        answer = report.report()
    assert answer["model"] == vllm_kimi_k3_moe.KIMI_K3_AMD_LINEAR
    names = [line.split(":")[0] for line in answer["fixes"]]
    # vLLM 0.33 has no direct-mode reload nor load plans: nothing to patch
    lacking = {"0.33.0": ("direct", "plan")}.get(version("vllm"), ())
    fixes = ["linear", "routed_experts", "strict_expert_loading", "default_loader"]
    fixes += ["int_wna16", "layerwise", "direct", "plan", "utils", "base"]
    assert names == [f"{'n/a' if f in lacking else 'on '} {f}" for f in fixes]
    assert answer["line"] is None  # verified code of a verified release
