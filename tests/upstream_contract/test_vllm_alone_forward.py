"""vLLM 0.33.0 alone (its own ``KimiMoE``, no plugin): what every rank's Kimi-K3
routed experts, through vLLM's own MoE forward and summed over the ranks,
compute against the unsharded experts, in every published format at TP16 and
TP32 and in INT4 groups of 128; where vLLM alone computes the wrong function,
the error is recorded here, and where it cannot build the layout (experts
split through data parallelism), its error.

The same comparison as ``tests/models/kimi_k3/test_forward_equivalence.py``
(the selftest's harness on the CPU reference kernel), with the plugin taken
out of the process as ``selftest`` takes it out (``harness.vllm_alone``),
run twice: with uninitialised memory reading as zero bytes (the most
favourable case for vLLM alone: a wrong result then comes from what it
loads, not from what memory held) and as 0xFF bytes (NaN in every float
format). If vLLM changes any of this, a row here fails.
"""

from __future__ import annotations

import math

import pytest

from tests.models.kimi_k3.builders import NAN_BYTE
from tests.models.kimi_k3.forward_cases import CPU, TOLERANCE, layer_cache, small_case
from tests.models.kimi_k3.gpu_stand_ins import uninitialised_memory_reads
from tests.models.kimi_k3.test_forward_equivalence import INT4_GROUPS_OF_128
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

EXACT = 0.0  # within the reference kernel's TOLERANCE, at every batch size
NAN = math.nan  # a NaN reached the kernel: the whole output is NaN
ZERO_BYTE = 0x00
TOKENS = 128  # a recorded error is the one over every token

# Relative error of the all-reduced output, measured on the harness's
# synthetic checkpoints and inputs. vLLM alone allocates 256 intermediate
# rows per rank at TP16 (192 loaded) and TP32 (96 loaded); a pad is what it
# allocated.
VLLM_ALONE = [
    # fmt, config (None: published), TP, memory read as zero bytes, as 0xFF
    # Mxfp4MoEMethod allocates with torch.zeros: the pads stay zero.
    ("mxfp4", None, 16, EXACT, EXACT),
    ("mxfp4", None, 32, EXACT, EXACT),
    # torch.empty weights and scales: memory decides.
    ("ct-mxfp4", None, 16, EXACT, NAN),
    ("ct-mxfp4", None, 32, EXACT, NAN),
    # Block scales: 3072 / 128 = 24 rows of them, split 24 // TP per rank.
    # TP16: rank r loads scale row r, but its 192 rows straddle checkpoint
    # blocks 1.5r .. 1.5r + 1.5; the rest keep their initial 1.0. TP32: 0 rows
    # per rank, no block scale is ever loaded, all are 1.0.
    ("fp8-block", None, 16, 0.9611, NAN),
    ("fp8-block", None, 32, 0.9625, NAN),
    ("nvfp4", None, 16, EXACT, NAN),
    ("nvfp4", None, 32, EXACT, NAN),
    ("modelopt-nvfp4", None, 16, EXACT, NAN),
    ("modelopt-nvfp4", None, 32, EXACT, NAN),
    # Group scales start at torch.ones: a pad nibble 0 reads as int4 -8
    # (offset 8) times 1.0, not 0, in both w13 and w2; 0xFF reads as +7.
    ("w4a16", None, 16, 11.28, 5.74),
    ("w4a16", None, 32, 56.38, 28.7),
    ("bf16", None, 16, EXACT, NAN),
    ("bf16", None, 32, EXACT, NAN),
]
# INT4 in groups of 128: vLLM alone loads 192 or 96 rows per rank with the
# group scales of 3072 / 128 = 24 groups split 24 // TP per rank (TP16: one,
# for 1.5 groups of rows; TP32: none), into 256 rows whose pad is int4 -8.
VLLM_ALONE += [
    ("w4a16", INT4_GROUPS_OF_128, 16, 11.63, 5.976),
    ("w4a16", INT4_GROUPS_OF_128, 32, 58.23, 29.77),
]
# Where vLLM alone does not build the layout at all: every expert split
# over 32 GPUs through data parallelism (96 rows each, no model-level
# padding), which its FP8 block method and Marlin's check refuse.
CANNOT_BUILD = [
    ("fp8-block", None, Topology(8, dp_size=4), "not divisible by weight "),
    ("fp8-block", None, Topology(4, dp_size=8), "not divisible by weight "),
    ("w4a16", INT4_GROUPS_OF_128, Topology(8, dp_size=4), "Marlin not supported"),
]


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    return layer_cache(lambda name: tmp_path_factory.mktemp(f"kimi-k3-{name}"))


def assert_recorded(errors: dict[int, float], recorded: float, what: str) -> None:
    if math.isnan(recorded):
        assert all(math.isnan(e) for e in errors.values()), f"{what}: {errors}"
    elif recorded == EXACT:
        assert all(e < TOLERANCE for e in errors.values()), f"{what}: {errors}"
    else:
        assert errors[TOKENS] == pytest.approx(recorded, rel=1e-3), f"{what}: {errors}"


@pytest.mark.parametrize(
    ("fmt", "config", "tp_size", "zero_memory", "nan_memory"),
    VLLM_ALONE,
    ids=[
        f"{fmt}{'-g128' if config else ''}-TP{tp_size}"
        for fmt, config, tp_size, *_ in VLLM_ALONE
    ],
)
def test_vllm_alone_against_the_unsharded_experts(
    fmt, config, tp_size, zero_memory, nan_memory, layer, kimi_model
):
    case = small_case(fmt, Topology(tp_size), config)
    for byte, recorded in ((ZERO_BYTE, zero_memory), (NAN_BYTE, nan_memory)):
        with vllm_alone(kimi_model):
            output = deployment_outputs(
                CPU,
                case,
                kimi_model,
                layer(case),
                building=lambda byte=byte: uninitialised_memory_reads(byte),
            )
        what = f"vLLM alone, {fmt}{' g128' if config else ''} TP{tp_size}, 0x{byte:02X}"
        assert_recorded(errors_of(output, layer(case)), recorded, what)


@pytest.mark.parametrize(
    ("fmt", "config", "topology", "refusal"),
    CANNOT_BUILD,
    ids=[f"{f}-{t.label().replace(' ', '-')}" for f, _, t, _ in CANNOT_BUILD],
)
def test_vllm_alone_cannot_build(fmt, config, topology, refusal, layer, kimi_model):
    case = small_case(fmt, topology, config)
    with vllm_alone(kimi_model), pytest.raises(ValueError, match=refusal):
        deployment_outputs(CPU, case, kimi_model, layer(case))
