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

pytestmark = pytest.mark.forward_equivalence

TP_SIZES = [16, 32]  # where vLLM alone pads: 3072 / 16 = 192 and / 32 = 96 < 256


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
    # NaN in every float weight and scale a pad is made of (FP8, E8M0, BF16,
    # FP32), which would poison the whole output if it reached the kernel.
    poisoned = deployment_output(
        case, moe_layers_only_model, kimi_model.KimiMoE, tp_size, NAN_BYTE
    )
    assert torch.equal(poisoned, plugin_outputs(case, tp_size)), (
        f"{case.fmt} TP{tp_size}"
    )
