"""DeepGEMM's MXFP4 kernel (native MXFP4, ``--moe-backend deep_gemm``: the
only DeepGEMM path Kimi-K3's SiTU reaches; its FP8 kernels refuse SiTU):
vLLM's own preparation, run on the CPU at every layout the plugin gives
the config, hands the compiled GEMM what it assumes (``deep_gemm_kernel``):
the loaded FP4 weights untouched, K-major, zero past the rows the GPU
holds; the loaded E8M0 scales as the UE8M0 bytes it reads, K-padded with
zeros, in its MN-major TMA layout, no NaN byte; the rows and width whole
multiples of its activations' groups; no more rows than the plugin
allocated, the layer's config as the plugin left it, and the kernel's
quantization config holding the prepared scales.
"""

from __future__ import annotations

import torch

from tests.models.kimi_k3.preparation.deep_gemm_kernel import (
    UE8M0_NAN,
    DeepGemmFp4Gemm,
)
from tests.models.kimi_k3.preparation.expert_rows import not_held
from tests.models.kimi_k3.preparation.harness import (
    PreparedRank,
    assert_prepared_right,
    layouts_on,
)
from tests.models.kimi_k3.preparation.kernel_inputs import (
    kernel_input_problems,
    layout_problems,
)

CONFIG = "mxfp4"  # native MXFP4, the release: the config DeepGEMM's MXFP4 takes


def problems_of(prepared: PreparedRank) -> list[str]:
    experts, choice, loaded = prepared.experts, prepared.choice, prepared.loaded
    rows = experts.w2_weight.shape[2] * 2  # w2's k: packed FP4
    held = prepared.case.rows
    found = []
    for name, size_k, gated in (("w13", prepared.width, True), ("w2", rows, False)):
        weight = getattr(experts, f"{name}_weight").data
        gemm = DeepGemmFp4Gemm(
            name, weight, getattr(experts, f"{name}_weight_scale").data, size_k
        )
        found += gemm.problems()
        if not torch.equal(weight, loaded[f"{name}_weight"]):
            found.append(f"{name}'s weights are not the loaded ones")
        beyond = (
            not_held(weight, held, 1, True)
            if gated
            else not_held(weight, held // 2, -1, False)
        )
        if any(part.any() for part in beyond):
            found.append(f"{name}'s weights past the {held} rows held are not zero")
        scale_bytes = gemm.scale_bytes()
        if not torch.equal(scale_bytes, loaded[f"{name}_weight_scale"]):
            found.append(
                f"{name}'s scales are not the loaded E8M0 bytes the kernel reads"
            )
        if gemm.scale_pads().any():
            found.append(f"{name}'s scales' K pad bytes are not zero")
        if (scale_bytes == UE8M0_NAN).any():
            found.append(f"{name}'s scales hold NaN (E8M0 byte {UE8M0_NAN})")
    found += kernel_input_problems(experts)
    found += layout_problems(experts, choice, prepared.width, rows)
    return [f"{prepared.case.label()}: {problem}" for problem in found]


def test_deep_gemm_mxfp4_preparation_is_what_the_kernel_reads(
    kimi_model, format_experts, one_cpu_thread
):
    from vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe import (
        DeepGemmFP4Experts,
    )

    cases = layouts_on(format_experts, CONFIG, "deep_gemm")
    assert_prepared_right(kimi_model, cases, problems_of, DeepGemmFP4Experts)
