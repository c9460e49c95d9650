"""vLLM 0.33.0 alone (its own ``KimiMoE``, no plugin): what every rank's Kimi-K3
routed experts, through vLLM's own MoE forward and summed over the ranks,
compute against the unsharded experts, in every published format at TP16 and
TP32. Where vLLM alone computes the wrong function, the error is recorded here.

The same comparison as ``tests/models/kimi_k3/test_forward_equivalence.py``
(``forward_on_cpu``), run twice: with uninitialised memory reading as zero
bytes (the most favourable case for vLLM alone: a wrong result then comes
from what it loads, not from what memory held) and as 0xFF bytes (NaN in every
float format). If vLLM changes any of this, a row here fails.
"""

from __future__ import annotations

import math

import pytest

from tests.models.kimi_k3.forward_on_cpu import (
    NAN_BYTE,
    TOLERANCE,
    deployment_output,
    forward_case,
    relative_error,
)
from vllm_kimi_k3_moe.patching import upstream_class

pytestmark = pytest.mark.forward_equivalence

EXACT = 0.0  # within forward_on_cpu.TOLERANCE of the unsharded experts
NAN = math.nan  # a NaN reached the kernel: the whole output is NaN
ZERO_BYTE = 0x00

# Relative error of the all-reduced output, measured on forward_on_cpu's
# checkpoints and inputs. vLLM alone allocates 256 intermediate rows per rank
# at TP16 (192 loaded) and TP32 (96 loaded); a pad is what it allocated.
VLLM_ALONE = [
    # fmt, TP, memory read as zero bytes, as 0xFF bytes
    # Mxfp4MoEMethod allocates with torch.zeros: the pads stay zero.
    ("mxfp4", 16, EXACT, EXACT),
    ("mxfp4", 32, EXACT, EXACT),
    # torch.empty weights and scales: memory decides.
    ("ct-mxfp4", 16, EXACT, NAN),
    ("ct-mxfp4", 32, EXACT, NAN),
    # Block scales: 3072 / 128 = 24 rows of them, split 24 // TP per rank.
    # TP16: rank r loads scale row r, but its 192 rows straddle checkpoint
    # blocks 1.5r .. 1.5r + 1.5; the rest keep their initial 1.0. TP32: 0 rows
    # per rank, no block scale is ever loaded, all are 1.0.
    ("fp8-block", 16, 0.3027, NAN),
    ("fp8-block", 32, 0.9468, NAN),
    ("nvfp4", 16, EXACT, NAN),
    ("nvfp4", 32, EXACT, NAN),
    ("modelopt-nvfp4", 16, EXACT, NAN),
    ("modelopt-nvfp4", 32, EXACT, NAN),
    # Group scales start at torch.ones: a pad nibble 0 reads as int4 -8
    # (offset 8) times 1.0, not 0, in both w13 and w2; 0xFF reads as +7.
    ("w4a16", 16, 1.493, 0.8078),
    ("w4a16", 32, 7.464, 4.039),
    ("bf16", 16, EXACT, NAN),
    ("bf16", 32, EXACT, NAN),
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """One written checkpoint per format, with its reference."""
    written = {}

    def case(fmt: str):
        if fmt not in written:
            directory = tmp_path_factory.mktemp(f"kimi-k3-forward-{fmt}")
            written[fmt] = forward_case(directory, fmt)
        return written[fmt]

    return case


def assert_recorded(error: float, recorded: float, what: str) -> None:
    if math.isnan(recorded):
        assert math.isnan(error), f"{what}: {error:.4g}, recorded NaN"
    elif recorded == EXACT:
        assert error < TOLERANCE, f"{what}: {error:.4g}, recorded exact"
    else:
        assert error == pytest.approx(recorded, rel=1e-3), f"{what}: {error:.4g}"


@pytest.mark.parametrize(
    ("fmt", "tp_size", "zero_memory", "nan_memory"),
    VLLM_ALONE,
    ids=[f"{fmt}-TP{tp_size}" for fmt, tp_size, *_ in VLLM_ALONE],
)
def test_vllm_alone_against_the_unsharded_experts(
    fmt, tp_size, zero_memory, nan_memory, cases, moe_layers_only_model, kimi_model
):
    case = cases(fmt)
    vllm_alone = upstream_class(kimi_model.KimiMoE)
    for byte, recorded in ((ZERO_BYTE, zero_memory), (NAN_BYTE, nan_memory)):
        output = deployment_output(
            case, moe_layers_only_model, vllm_alone, tp_size, byte
        )
        what = f"vLLM alone, {fmt} TP{tp_size}, memory 0x{byte:02X}"
        assert_recorded(relative_error(output, case.expected), recorded, what)
