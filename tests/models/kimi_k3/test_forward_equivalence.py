"""With the plugin, every rank's Kimi-K3 routed experts, through vLLM's own MoE
forward, add up to the unsharded experts, in every published format at TP16
and TP32, and pads poisoned with NaN bytes before loading change no bit.

Each rank is built and loaded as vLLM builds and loads it (``forward_on_cpu``:
the checkpoint's config, ``DefaultModelLoader``, Kimi-K3's name mapping),
routed by its own router and run through vLLM's batched reference kernel
with the layer's SiTU (betas 4.0 / 25.0), in FP32 after vLLM's dequantizers.
The sum over ranks is what the TP all-reduce computes; the reference is the
checkpoint's experts in float64, computed in plain torch.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.kimi_k3.forward_on_cpu import (
    FORMATS,
    NAN_BYTE,
    TOLERANCE,
    deployment_output,
    forward_case,
    relative_error,
)
from vllm_kimi_k3_moe.patching import upstream_class

pytestmark = pytest.mark.forward_equivalence

TP_SIZES = [16, 32]  # where vLLM alone pads: 3072 / 16 = 192 and / 32 = 96 < 256
# MXFP4 at TP16: 192 rows per rank, and Marlin's multiple of 128 and vLLM
# alone's minimum are both 256: the plugin allocates what vLLM alone does.
SAME_LAYOUT_TP = 16


@pytest.fixture(scope="module", params=FORMATS)
def case(request, tmp_path_factory):
    fmt = request.param
    return forward_case(tmp_path_factory.mktemp(f"kimi-k3-forward-{fmt}"), fmt)


@pytest.fixture(scope="module")
def plugin_outputs(moe_layers_only_model, kimi_model):
    """Each deployment's output with the plugin, memory as the CPU gives it:
    computed once, read by both tests."""
    outputs: dict[tuple[str, int], torch.Tensor] = {}

    def output(case, tp_size: int) -> torch.Tensor:
        key = case.fmt, tp_size
        if key not in outputs:
            outputs[key] = deployment_output(
                case, moe_layers_only_model, kimi_model.KimiMoE, tp_size
            )
        return outputs[key]

    return output


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_ranks_sum_to_the_unsharded_experts(case, tp_size, plugin_outputs):
    error = relative_error(plugin_outputs(case, tp_size), case.expected)
    assert math.isfinite(error) and error < TOLERANCE, f"{case.fmt} TP{tp_size}"


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_nan_poisoned_memory_changes_no_bit(
    case, tp_size, plugin_outputs, moe_layers_only_model, kimi_model
):
    # Every uninitialised byte is 0xFF while the ranks are built and loaded:
    # NaN in every float format that has one (BF16, FP32, FP8 E4M3, E8M0
    # scales), which poisons the whole output if it reaches the kernel. (An
    # FP4 nibble 0xF is -6.0 and an int4 one +7; native MXFP4 allocates with
    # torch.zeros, so nothing of it is uninitialised.)
    poisoned = deployment_output(
        case, moe_layers_only_model, kimi_model.KimiMoE, tp_size, NAN_BYTE
    )
    assert torch.equal(poisoned, plugin_outputs(case, tp_size)), (
        f"{case.fmt} TP{tp_size}"
    )


# Where the plugin allocates what vLLM alone allocates and loads the same rows,
# the arithmetic is the same, and so is every bit of the output.
@pytest.mark.parametrize("case", ["mxfp4", "ct-mxfp4"], indirect=True)
def test_same_layout_as_vllm_alone_gives_the_same_bits(
    case, plugin_outputs, moe_layers_only_model, kimi_model
):
    # vLLM alone's torch.empty pads read as zero bytes: its best case
    vllm_alone = deployment_output(
        case,
        moe_layers_only_model,
        upstream_class(kimi_model.KimiMoE),
        SAME_LAYOUT_TP,
        0x00,
    )
    assert torch.equal(vllm_alone, plugin_outputs(case, SAME_LAYOUT_TP))
