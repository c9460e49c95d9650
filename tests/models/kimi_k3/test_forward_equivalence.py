"""With the plugin, every rank's Kimi-K3 routed experts, through vLLM's own MoE
forward, add up to the unsharded experts, in every published format at TP16
and TP32, in INT4 groups of 128 (each GPU whole groups) and with the experts
split through data parallelism (TP8 x DP4, TP4 x DP8: each rank its own TP
and DP rank), and pads poisoned with NaN bytes before loading change no
bit.

The selftest's harness on vLLM's CPU reference kernel (``forward_cases``):
each rank built and loaded as vLLM builds and loads it (the checkpoint's
config, the plugin's partition, Kimi-K3's name mapping), routed by its own
router and run through ``NaiveBatchedExperts`` with the layer's SiTU (betas
4.0 / 25.0), in FP32 after vLLM's dequantizers, on 1, 16 and 128 tokens.
The sum over ranks is what the all-reduce computes; the reference is the
checkpoint's experts in float64, computed in plain torch.

A case is one row of ``CASES``: the format, its quantization config (None:
the published one) and the layout.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.kimi_k3.builders import NAN_BYTE
from tests.models.kimi_k3.forward_cases import CPU, TOLERANCE, layer_cache, small_case
from tests.models.kimi_k3.gpu_stand_ins import uninitialised_memory_reads
from tests.models.kimi_k3.quantization_space import compressed_tensors_int
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.selftest.harness import (
    deployment_outputs,
    errors_of,
    vllm_alone,
)

pytestmark = [
    pytest.mark.forward_equivalence,
    pytest.mark.usefixtures("one_cpu_thread"),
]

# INT4 in symmetric groups of 128 (GPTQ / AutoRound conversions): at TP16,
# TP32 and TP8 x DP4 a GPU's even slice (192, 96, 96 rows) splits a group.
INT4_GROUPS_OF_128 = compressed_tensors_int(4, 128, True)
# vLLM alone pads at TP16 (3072 / 16 = 192 < 256) and TP32 (96); it pads
# nothing at TP8 x DP4 and TP4 x DP8 (every expert over 32 GPUs: 96 rows).
CASES = [
    # format, quantization_config (None: published), layout
    ("mxfp4", None, Topology(16)),
    ("mxfp4", None, Topology(32)),
    ("ct-mxfp4", None, Topology(16)),
    ("ct-mxfp4", None, Topology(32)),
    ("fp8-block", None, Topology(16)),
    ("fp8-block", None, Topology(32)),
    ("nvfp4", None, Topology(16)),
    ("nvfp4", None, Topology(32)),
    ("modelopt-nvfp4", None, Topology(16)),
    ("modelopt-nvfp4", None, Topology(32)),
    ("w4a16", None, Topology(16)),
    ("w4a16", None, Topology(32)),
    ("bf16", None, Topology(16)),
    ("bf16", None, Topology(32)),
    ("w4a16", INT4_GROUPS_OF_128, Topology(16)),
    ("w4a16", INT4_GROUPS_OF_128, Topology(32)),
    ("w4a16", INT4_GROUPS_OF_128, Topology(8, dp_size=4)),
    ("fp8-block", None, Topology(8, dp_size=4)),
    ("fp8-block", None, Topology(4, dp_size=8)),
]
ROW = ("fmt", "config", "topology")
IDS = [
    f"{fmt}{'-g128' if config else ''}-{topology.label().replace(' ', '-')}"
    for fmt, config, topology in CASES
]
cases = pytest.mark.parametrize(ROW, CASES, ids=IDS)


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    return layer_cache(lambda name: tmp_path_factory.mktemp(f"kimi-k3-{name}"))


@pytest.fixture(scope="module")
def plugin_outputs(layer, kimi_model):
    """Each case's summed output with the plugin, memory as the CPU gives
    it: computed once, read by several tests."""
    outputs: dict[str, dict[int, torch.Tensor]] = {}

    def output(case) -> dict[int, torch.Tensor]:
        key = repr(case)
        if key not in outputs:
            outputs[key] = deployment_outputs(CPU, case, kimi_model, layer(case))
        return outputs[key]

    return output


@cases
def test_ranks_sum_to_the_unsharded_experts(
    fmt, config, topology, layer, plugin_outputs
):
    case = small_case(fmt, topology, config)
    errors = errors_of(plugin_outputs(case), layer(case))
    assert all(math.isfinite(e) and e < TOLERANCE for e in errors.values()), errors


@cases
def test_nan_poisoned_memory_changes_no_bit(
    fmt, config, topology, layer, plugin_outputs, kimi_model
):
    # Every uninitialised byte is 0xFF while the ranks are built and loaded:
    # NaN in every float format that has one (BF16, FP32, FP8 E4M3, E8M0
    # scales), which poisons the whole output if it reaches the kernel. (An
    # FP4 nibble 0xF is -6.0 and an int4 one +7; native MXFP4 allocates with
    # torch.zeros, so nothing of it is uninitialised.)
    case = small_case(fmt, topology, config)
    poisoned = deployment_outputs(
        CPU,
        case,
        kimi_model,
        layer(case),
        building=lambda: uninitialised_memory_reads(NAN_BYTE),
    )
    clean = plugin_outputs(case)
    assert all(torch.equal(poisoned[n], clean[n]) for n in clean)


# Where the plugin allocates what vLLM alone allocates and loads the same rows
# (MXFP4 at TP16: Marlin's multiple of 128 and vLLM alone's minimum are both
# 256), the arithmetic is the same, and so is every bit of the output.
@pytest.mark.parametrize("fmt", ["mxfp4", "ct-mxfp4"])
def test_same_layout_as_vllm_alone_gives_the_same_bits(
    fmt, layer, plugin_outputs, kimi_model
):
    case = small_case(fmt, Topology(16))
    with vllm_alone(kimi_model):
        # vLLM alone's torch.empty pads read as zero bytes: its best case
        alone = deployment_outputs(
            CPU,
            case,
            kimi_model,
            layer(case),
            building=lambda: uninitialised_memory_reads(0x00),
        )
    clean = plugin_outputs(case)
    assert all(torch.equal(alone[n], clean[n]) for n in clean)
