"""Marlin's integer MoE kernel (compressed-tensors INT4/INT8, AutoAWQ,
AutoGPTQ): vLLM's own weight preparation, run on the CPU at every layout
the plugin gives each config, hands the compiled GEMM what it assumes
(``marlin_kernel``): scales laid out for the group it infers, whole thread
tiles, finite scales, the checkpoint's weights with zero pads, and no more
rows than the plugin allocated.

The scale layout is where the plugin's whole 128-row groups (TP32, TP8 x
DP4, TP4 x DP8 and TP16 x DP2, groups of 128) met vLLM's preparation
wrong: it permutes w13's scales for the rows instead of the width
(``oracle/int_wna16.py``; the plugin's ``oracle.int_wna16`` patch).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.models.kimi_k3.preparation.harness import (
    PreparationCase,
    PreparedRank,
    configs_of,
    prepare_rank,
    representatives,
)
from tests.models.kimi_k3.preparation.marlin_kernel import MarlinGemm
from tests.models.kimi_k3.preparation.stand_ins.marlin import unrepacked
from vllm_kimi_k3_moe.compat import marlin_int8_activations_exist
from vllm_kimi_k3_moe.tools.deployment.topology import Topology


@dataclass(frozen=True)
class Parameters:
    """A WNA16 method's expert parameter names and loaded layout."""

    weight: str
    scale: str
    zero: str
    n_first: bool  # loaded [E, rows, K...] (compressed-tensors' canonical)
    packed_along_k: bool  # GPTQ-style packing (AWQ packs along the rows)


PARAMETERS = {
    "CompressedTensorsWNA16MoEMethod": Parameters(
        "weight_packed", "weight_scale", "weight_zero_point", True, True
    ),
    "AutoGPTQMoEMethod": Parameters("qweight", "scales", "qzeros", False, True),
    "AutoAWQMoEMethod": Parameters("qweight", "scales", "qzeros", False, False),
}
CONFIGS = configs_of("w4a16", "awq", "gptq")


def k_first(tensor: torch.Tensor, n_first: bool) -> torch.Tensor:
    return tensor.transpose(1, 2) if n_first else tensor


def pad_gate_and_up(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """w13's K-first ``[E, groups, 2 x N]`` with gate and up each zero-padded
    to ``rows`` columns."""
    experts, groups, both = scales.shape
    halves = scales.reshape(experts, groups, 2, both // 2)
    padded = torch.nn.functional.pad(halves, (0, rows - both // 2))
    return padded.reshape(experts, groups, 2 * rows)


def gemms(
    prepared: PreparedRank, is_a_8bit: bool = False, int8_scales: bool = False
) -> list[MarlinGemm]:
    """The layer's two GEMMs as the kernel will be called on them."""
    experts = prepared.experts
    names = PARAMETERS[type(experts.quant_method).__name__]
    loaded, width = prepared.loaded, prepared.width
    w13_scales = getattr(experts, f"w13_{names.scale}").data
    w2_scales = getattr(experts, f"w2_{names.scale}").data
    rows = w13_scales.shape[2] // 2  # what the kernel runs: the prepared rows
    loaded_w13 = k_first(loaded[f"w13_{names.scale}"], names.n_first)
    loaded_w2 = k_first(loaded[f"w2_{names.scale}"], names.n_first)
    w2_groups = w2_scales.shape[1]
    loaded_w2 = torch.nn.functional.pad(
        loaded_w2, (0, 0, 0, w2_groups - loaded_w2.shape[1])
    )
    zeros = {
        name: getattr(experts, f"{name}_{names.zero}", None) for name in ("w13", "w2")
    }
    pack = 32 // _bits(experts)
    return [
        MarlinGemm(
            "w13",
            width,
            2 * rows,
            w13_scales,
            pad_gate_and_up(loaded_w13, rows),
            is_a_8bit,
            zeros["w13"],
            pack,
            int8_scales=int8_scales,
        ),
        MarlinGemm(
            "w2",
            rows,
            width,
            w2_scales,
            loaded_w2,
            is_a_8bit,
            zeros["w2"],
            pack,
            int8_scales=int8_scales,
        ),
    ]


def weight_problems(
    prepared: PreparedRank, rows: int, is_a_8bit: bool = False
) -> list[str]:
    """The repacked w13 read back is the loaded one, gate and up each
    zero-padded to the prepared rows (the repack's stand-in keeps values)."""
    experts = prepared.experts
    names = PARAMETERS[type(experts.quant_method).__name__]
    bits = _bits(experts)
    loaded = k_first(prepared.loaded[f"w13_{names.weight}"], names.n_first)
    pack = 32 // bits
    unit = rows if names.packed_along_k else rows // pack
    expected = pad_gate_and_up(loaded, unit)
    found = unrepacked(
        getattr(experts, f"w13_{names.weight}").data,
        prepared.width,
        bits,
        names.packed_along_k,
        is_a_8bit,
    )
    if not torch.equal(found, expected):
        return ["w13's weights are not the loaded ones with zero pads"]
    return []


def _bits(experts) -> int:
    method = experts.quant_method
    bits = getattr(method, "num_bits", None)
    return bits if bits is not None else method.quant_config.weight_bits


def problems_of(
    prepared: PreparedRank, is_a_8bit: bool = False, int8_scales: bool = False
) -> list[str]:
    found = []
    for gemm in gemms(prepared, is_a_8bit, int8_scales):
        found += gemm.problems()
    rows = gemms(prepared)[0].size_n // 2
    found += weight_problems(prepared, rows, is_a_8bit)
    if rows != prepared.choice.allocated:
        found.append(
            f"preparation re-pads {prepared.choice.allocated} rows to {rows}: "
            f"{rows} resident, a second copy while it pads"
        )
    return [f"{prepared.case.label()}: {problem}" for problem in found]


@pytest.mark.parametrize("config", CONFIGS)
def test_marlin_integer_preparation_is_what_the_kernel_reads(
    kimi_model, format_experts, config, one_cpu_thread
):
    cases = representatives(format_experts, config, "marlin")
    assert cases, f"{config}: the plugin builds no layout on Marlin"
    found, prepared = [], 0
    for case in cases:
        rank = prepare_rank(kimi_model, case)
        if type(rank.experts.quant_method).__name__ in PARAMETERS:
            prepared += 1
            found += problems_of(rank)
        # else: AutoAWQ's and AutoGPTQ's fallback (MoeWNA16Method, Triton)
    assert prepared, f"{config}: no layout runs Marlin's integer kernel"
    assert not found, "\n".join(found)


# the configs whose MoE method takes INT8 activations on Marlin (AutoAWQ's
# ignores VLLM_MARLIN_INPUT_DTYPE, AutoGPTQ's refuses it for INT4)
INT8_ACTIVATION_CONFIGS = ("ct-int4-g128-sym", "ct-int4-g128-asym")


@pytest.mark.skipif(
    not marlin_int8_activations_exist(),
    reason="this vLLM has no Marlin INT8-activation path (0.34 removed it)",
)
@pytest.mark.parametrize("config", INT8_ACTIVATION_CONFIGS)
def test_int8_activations_at_whole_groups(
    kimi_model, config, monkeypatch, one_cpu_thread
):
    """``VLLM_MARLIN_INPUT_DTYPE=int8`` at TP32 in whole 128-row groups:
    GPU 0's scales are what the kernel reads; GPUs 24-31 hold no rows, and
    vLLM's INT8 scale step (``marlin_act_int8_process_scales``), which
    divides by the largest scale, leaves them a zero global scale: the
    kernel scales their activations by it, so they add exactly zero."""
    monkeypatch.setenv("VLLM_MARLIN_INPUT_DTYPE", "int8")
    for rank, rows in ((0, 128), (31, 0)):
        case = PreparationCase(config, "marlin", Topology(32), rank, rows)
        prepared = prepare_rank(kimi_model, case)
        assert prepared.experts.quant_method.input_dtype == torch.int8
        found = problems_of(prepared, is_a_8bit=True, int8_scales=True)
        assert not found, "\n".join(found)
        global_scale = prepared.experts.w13_input_global_scale
        assert bool(torch.isfinite(global_scale).all())
        assert bool((global_scale == 0).all()) == (rows == 0), case.label()
