"""vLLM's Triton MoE kernel (``--moe-backend triton``): FP8 in [128, 128]
blocks and per output channel (compressed-tensors), and BF16 (Triton is the
only NVIDIA kernel that runs Kimi-K3's SiTU unquantized). Its preparation
(``convert_to_fp8_moe_kernel_format``, ``convert_to_unquantized_kernel_format``)
lays nothing out again; run on the CPU at every layout the plugin gives each
config, it hands the kernel what it assumes (``triton_kernel``): the loaded
weights and scales as they were, the scales its quantization config reads
(shape, blocks aligned to gate and up, finite, also on GPUs holding no rows),
zero past the rows the GPU holds, no NaN weight, no more rows than the
plugin allocated, the layer's config as the plugin left it.

FP8 per tensor does not reach Triton: compressed-tensors gives per-tensor
weights with dynamic activations a per-group activation key that Triton's
FP8 schemes do not take (``test_fp8_per_tensor_does_not_reach_triton``).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.kimi_k3.preparation.expert_rows import not_held
from tests.models.kimi_k3.preparation.harness import (
    PreparedRank,
    assert_prepared_right,
    layouts_on,
)
from tests.models.kimi_k3.preparation.kernel_inputs import (
    kernel_input_problems,
    layout_problems,
    quant_config,
)
from tests.models.kimi_k3.preparation.triton_kernel import TritonGemm
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

CONFIGS = ("fp8-block", "ct-fp8-channel", "bf16")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def problems_of(prepared: PreparedRank) -> list[str]:
    experts, choice, loaded = prepared.experts, prepared.choice, prepared.loaded
    kernel = quant_config(experts)
    block = kernel.block_shape
    rows = experts.w2_weight.shape[2]
    held = prepared.case.rows
    found = []
    for name, gated, scales in (
        ("w13", True, kernel.w1_scale),
        ("w2", False, kernel.w2_scale),
    ):
        weight = getattr(experts, f"{name}_weight").data
        gemm = TritonGemm(
            name,
            weight,
            scales,
            None if block is None else tuple(block),
            kernel.per_act_token_quant,
            gated,
        )
        found += gemm.problems()
        for suffix in ("weight", "weight_scale"):
            now = getattr(experts, f"{name}_{suffix}", None)
            if now is not None and not torch.equal(
                _bytes(now.data), _bytes(loaded[f"{name}_{suffix}"])
            ):
                found.append(f"{name}_{suffix} is not the loaded one")
        beyond = (
            not_held(weight, held, 1, True)
            if gated
            else not_held(weight, held, -1, False)
        )
        if any(part.any() for part in beyond):
            found.append(f"{name}'s weights past the {held} rows held are not zero")
        if not torch.isfinite(weight.float()).all():
            found.append(f"{name}'s weights are not finite")
    if experts.w13_weight.shape[1] != 2 * rows:
        found.append(f"w13 holds {experts.w13_weight.shape[1]} rows, w2 {rows}")
    found += kernel_input_problems(experts)
    found += layout_problems(experts, choice, prepared.width, rows)
    return [f"{prepared.case.label()}: {problem}" for problem in found]


@pytest.mark.parametrize("config", CONFIGS)
def test_triton_preparation_is_what_the_kernel_reads(
    kimi_model, format_experts, config, one_cpu_thread
):
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import (
        TritonExperts,
    )

    cases = layouts_on(format_experts, config, "triton")
    assert_prepared_right(kimi_model, cases, problems_of, TritonExperts)


def test_fp8_per_tensor_does_not_reach_triton(format_experts):
    """Compressed-tensors FP8 per tensor with dynamic activations: vLLM
    refuses Triton for it (``--moe-backend triton``: the activations' key is
    per group of 128, ``CompressedTensorsW8A8Fp8MoEMethod``), so nothing of
    the plugin's is prepared for Triton there."""
    with pytest.raises(ValueError, match=r"TRITON\W.* quantization scheme"):
        format_experts("ct-fp8-tensor", "triton", Topology(1))
