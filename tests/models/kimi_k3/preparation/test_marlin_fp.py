"""Marlin's FP weights (native and compressed-tensors MXFP4, compressed-tensors
and ModelOpt NVFP4, compressed-tensors FP8 in [128, 128] blocks, per output
channel and per tensor): vLLM's own preparation, run on the CPU at every
layout the plugin gives each config on ``--moe-backend marlin``, hands the
compiled GEMM what it assumes (``marlin_kernel``): scales, as the kernel
decodes them, that are the loaded ones laid out for the group it infers, in
a group it is compiled for, finite; whole thread tiles; the loaded weights
in Marlin's tiles with zero pads (read back through the repack stand-in's
inverse), zero past the rows the GPU holds; no more rows than the plugin
allocated, and the layer's config as the plugin left it.

Compressed-tensors MXFP4 picks CUTLASS or Marlin from the GPU, whatever
``--moe-backend`` says: the rank is built and prepared as on a GPU without
CUTLASS MXFP4 (``stand_ins.compressed_tensors_mxfp4_kernel``), its layouts
are those the never-worse matrix builds (with every device check yes, that
is CUTLASS's): each prepared rank is checked to be the layout it stands for.

FP8 per channel and per tensor have no format of the registry: their rule
is learned from the method (``learned_rule``), and Marlin's resident rows
(``prepare_fp8_moe_layer_for_marlin`` pads to
``marlin_moe_padded_intermediate(n, -1)``, a multiple of 64) are what the
plugin allocates for them, as for every format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.models.kimi_k3.preparation.expert_rows import (
    not_held,
    pad_gate_and_up,
    pad_to,
)
from tests.models.kimi_k3.preparation.harness import (
    PreparationCase,
    PreparedRank,
    prepare_rank,
    prepare_vllm_alone_rank,
    representatives,
    rows_held,
)
from tests.models.kimi_k3.preparation.kernel_inputs import (
    kernel_input_problems,
    layout_problems,
)
from tests.models.kimi_k3.preparation.marlin_kernel import (
    FP8_GROUPS,
    MXFP4_GROUPS,
    NVFP4_GROUPS,
    MarlinGemm,
    e8m0_scales,
    fp8_scales,
    nvfp4_scales,
)
from tests.models.kimi_k3.preparation.stand_ins.marlin import MARLIN_TILE, unrepacked
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

CONFIGS = (
    "mxfp4",
    "ct-mxfp4",
    "nvfp4",
    "modelopt-nvfp4",
    "fp8-block",
    "ct-fp8-channel",
    "ct-fp8-tensor",
)


@dataclass(frozen=True)
class FpWeights:
    """How one FP method's experts are loaded and what its kernel reads."""

    loaded: str  # the weights' parameter suffix as loaded
    bits: int  # FP4: two values a byte; FP8: one
    groups: tuple[int, ...]  # the groups the kernel is compiled for
    read: Callable[[Any], Any]  # the scale values the kernel reads
    loaded_values: Callable[[Any], Any]  # the loaded scales' values
    common_power_of_two: bool = False  # NVFP4: scales x the layer's 2^n


def _e8m0(scales: Any) -> Any:
    return scales.view(torch.float8_e8m0fnu).float()


def _fp8_scale(scales: Any) -> Any:
    # the kernel reads FP8 weights' scales in BF16, the activations' dtype
    return scales.to(torch.bfloat16).float()


METHODS = {
    "Mxfp4MoEMethod": FpWeights("weight", 4, MXFP4_GROUPS, e8m0_scales, _e8m0),
    "CompressedTensorsW4A4Mxfp4MoEMethod": FpWeights(
        "weight_packed", 4, MXFP4_GROUPS, e8m0_scales, _e8m0
    ),
    "CompressedTensorsW4A4Nvfp4MoEMethod": FpWeights(
        "weight_packed", 4, NVFP4_GROUPS, nvfp4_scales, torch.Tensor.float, True
    ),
    "ModelOptNvFp4FusedMoE": FpWeights(
        "weight", 4, NVFP4_GROUPS, nvfp4_scales, torch.Tensor.float, True
    ),
    "CompressedTensorsW8A8Fp8MoEMethod": FpWeights(
        "weight", 8, FP8_GROUPS, fp8_scales, _fp8_scale
    ),
}


def _method(prepared: PreparedRank) -> FpWeights:
    return METHODS[type(prepared.experts.quant_method).__name__]


def _per_tensor(prepared: PreparedRank) -> bool:
    return prepared.loaded["w2_weight_scale"].dim() == 1


def loaded_scales(prepared: PreparedRank, name: str) -> Any:
    """The loaded scales' values, K-first, one per output column:
    ``[experts, groups, outputs]`` (FP8 blocks: each block's scale on each
    of its rows; per tensor: the one scale vLLM requantizes w1 and w3 to,
    the larger)."""
    fmt = _method(prepared)
    scales = fmt.loaded_values(prepared.loaded[f"{name}_weight_scale"])
    outputs = prepared.loaded[f"{name}_{fmt.loaded}"].shape[1]
    block = getattr(prepared.experts.quant_method, "weight_block_size", None)
    if block is not None:
        scales = scales.repeat_interleave(block[0], dim=1)[:, :outputs]
    elif _per_tensor(prepared):
        largest = scales.reshape(scales.shape[0], -1).max(dim=1).values
        return largest.reshape(-1, 1, 1).expand(-1, 1, outputs)
    return scales.transpose(1, 2)


def gemms(prepared: PreparedRank, rows: int) -> list[MarlinGemm]:
    """The layer's two GEMMs as the kernel will be called on them."""
    experts, fmt, width = prepared.experts, _method(prepared), prepared.width
    w13_scales = experts.w13_weight_scale.data
    w2_scales = experts.w2_weight_scale.data
    loaded_w13 = pad_gate_and_up(loaded_scales(prepared, "w13"), rows, dim=-1)
    loaded_w2 = pad_to(loaded_scales(prepared, "w2"), w2_scales.shape[1], dim=1)
    common = {
        "groups": fmt.groups,
        "read": fmt.read,
        "common_power_of_two": fmt.common_power_of_two,
    }
    return [
        MarlinGemm("w13", width, 2 * rows, w13_scales, loaded_w13, **common),
        MarlinGemm("w2", rows, width, w2_scales, loaded_w2, **common),
    ]


def marlin_weight(repacked: Any, size_k: int, bits: int) -> Any:
    """A Marlin-repacked weight read back as the bytes it was repacked
    from, ``[experts, size_n, size_k x bits / 8]`` (vLLM packs each expert's
    ``[size_n, size_k]`` rows as int32 along K and transposes them)."""
    packed = unrepacked(repacked, size_k, bits, along_k=True)
    return packed.transpose(1, 2).contiguous().view(torch.uint8)


def _requantized_right(found: Any, prepared: PreparedRank, expected: Any) -> bool:
    """Per-tensor w13: vLLM requantizes w1 and w3 to the larger of their
    scales; dequantized, each is the loaded one to within E4M3's rounding
    (half a unit in the last place: 2^-4 relative, 2^-10 times the scale
    below E4M3's normal range), and a half whose scale was the larger keeps
    its codes."""
    scales = prepared.loaded["w13_weight_scale"]  # [E, 2]: w1's, w3's
    largest = scales.max(dim=1).values
    halves = list(zip(found.chunk(2, 1), expected.chunk(2, 1), strict=True))
    for half, (now, loaded) in enumerate(halves):
        scale = scales[:, half].reshape(-1, 1, 1)
        then = loaded.view(torch.float8_e4m3fn).float() * scale
        got = now.view(torch.float8_e4m3fn).float() * largest.reshape(-1, 1, 1)
        bound = then.abs() * 2**-4 + largest.reshape(-1, 1, 1) * 2**-10
        if not ((got - then).abs() <= bound).all():
            return False
        for expert in torch.nonzero(scales[:, half] == largest).flatten():
            if not torch.equal(now[expert], loaded[expert]):
                return False
    return True


def weight_problems(prepared: PreparedRank, rows: int) -> list[str]:
    """The repacked weights read back are the loaded ones, gate and up each
    zero-padded to the prepared rows, and zero (no NaN) past the rows the
    GPU holds."""
    fmt, found_problems = _method(prepared), []
    held = prepared.case.rows
    per_byte = 8 // fmt.bits
    for name, size_k, gated in (("w13", prepared.width, True), ("w2", rows, False)):
        found = marlin_weight(
            getattr(prepared.experts, f"{name}_weight").data, size_k, fmt.bits
        )
        loaded = prepared.loaded[f"{name}_{fmt.loaded}"].view(torch.uint8)
        if gated:
            expected = pad_gate_and_up(loaded, rows, dim=1)
        else:
            expected = pad_to(loaded, rows // per_byte, dim=-1)
        if gated and fmt.bits == 8 and _per_tensor(prepared):
            right = _requantized_right(found, prepared, expected)
        else:
            right = torch.equal(found, expected)
        if not right:
            found_problems.append(
                f"{name}'s weights are not the loaded ones with zero pads"
            )
        beyond = (
            not_held(found, held, 1, True)
            if gated
            else not_held(found, held // per_byte, -1, False)
        )
        if any(part.any() for part in beyond):
            found_problems.append(
                f"{name}'s weights past the {held} rows held are not zero"
            )
        if (
            fmt.bits == 8
            and not torch.isfinite(found.view(torch.float8_e4m3fn).float()).all()
        ):
            found_problems.append(f"{name}'s FP8 weights hold NaN")
    return found_problems


def problems_of(prepared: PreparedRank) -> list[str]:
    experts, choice = prepared.experts, prepared.choice
    rows = experts.w2_weight.shape[1] * MARLIN_TILE  # the kernel's N
    found = []
    for gemm in gemms(prepared, rows):
        found += gemm.problems()
    found += weight_problems(prepared, rows)
    found += kernel_input_problems(experts)
    found += layout_problems(experts, choice, prepared.width, rows)
    return [f"{prepared.case.label()}: {problem}" for problem in found]


def _prepared(kimi_model, case: PreparationCase) -> PreparedRank:
    """``case`` prepared on Marlin, checked to be the layout it stands for."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts

    prepared = prepare_rank(kimi_model, case)
    method = prepared.experts.quant_method
    assert method.experts_cls is MarlinExperts, case.label()
    assert type(method).__name__ in METHODS, case.label()
    intermediate = prepared.experts.moe_config.intermediate_size
    held = rows_held(prepared.choice, intermediate, case.topology)
    assert held[case.rank] == case.rows, case.label()
    assert prepared.choice.allocated == case.allocated, case.label()
    return prepared


def _cases(format_experts, config: str) -> list[PreparationCase]:
    """The config's layouts on Marlin."""
    cases = representatives(format_experts, config, "marlin")
    assert cases, f"{config}: the plugin builds no layout on Marlin"
    return cases


@pytest.mark.parametrize("config", CONFIGS)
def test_marlin_fp_preparation_is_what_the_kernel_reads(
    kimi_model, format_experts, config, one_cpu_thread
):
    found = []
    for case in _cases(format_experts, config):
        found += problems_of(_prepared(kimi_model, case))
    assert not found, "\n".join(found)


def test_selftest_says_what_vllm_alones_kernel_keeps(kimi_model, one_cpu_thread):
    """NVFP4 at TP8 x DP4: vLLM alone allocates the bare 96 rows, which
    Marlin's preparation pads again; selftest's vLLM alone line gives the
    rows its prepared weights hold (the kernel's N), not the 96."""
    from vllm_kimi_k3_moe.tools.selftest.run import kept_rows

    case = PreparationCase("nvfp4", "marlin", Topology(8, dp_size=4))
    experts = prepare_vllm_alone_rank(kimi_model, case)
    kept = experts.w2_weight.shape[1] * MARLIN_TILE  # the kernel's N
    assert experts.intermediate_size_per_partition == 96
    assert kept_rows(experts) == kept == 128
