"""With the plugin, Kimi-K3 in every published format gets the smallest
per-rank partition vLLM's own code accepts, never larger than vLLM alone's;
a method no format names gets the same from the rule learned from it. (That it
builds wherever vLLM alone builds, on the same kernel, over the space of
configs vLLM accepts: ``test_never_worse_matrix``.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.models.kimi_k3.kimi_k3_formats import LEARNED_FORMAT
from vllm_kimi_k3_moe.formats import format_of_method
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import resident
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import kernel_of
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

TOPOLOGIES = [
    Topology(1),
    Topology(4),
    Topology(8),  # 3072 // 8 == 384: vLLM alone pads nothing
    Topology(12),  # 256: exactly the model-level minimum
    Topology(16),  # 192 -> vLLM alone 256
    Topology(24),  # 128 -> vLLM alone 256
    Topology(32),  # 96 -> vLLM alone 256
    Topology(16, dp_size=2),  # experts split over 32 GPUs; vLLM alone 128
    Topology(32, expert_parallel=True),  # whole experts: no model-level padding
    Topology(8, dp_size=4),  # split over 32 GPUs; vLLM alone pads nothing: 96
]

Outcome = int | tuple[str, str]  # partition, or (exception type, message)


@pytest.fixture
def outcome(format_experts) -> Callable[..., Outcome]:
    """Rank 0's routed-expert partition on the meta device, or the error vLLM
    raised building it (``format_experts`` takes the same arguments)."""

    def build(*args, **kwargs) -> Outcome:
        try:
            return format_experts(*args, **kwargs).intermediate_size_per_partition
        except Exception as error:
            return type(error).__name__, str(error)

    return build


# Per-rank partition at TP8, 16, 24, 32, TP16 x DP2, TP32 EP, per format and a
# kernel vLLM selects for Kimi-K3 on NVIDIA. vLLM alone: 384, 256, 256, 256,
# 128, 3072 for every one of them.
ALIGNED_TOPOLOGIES = TOPOLOGIES[2:3] + TOPOLOGIES[4:9]
PARTITIONS = [
    # MXFP4 Marlin and DeepGEMM: multiples of 128 (MXFP4 sizing oracle)
    ("mxfp4", "marlin", [384, 256, 128, 128, 128, 3072]),
    ("mxfp4", "deep_gemm", [384, 256, 128, 128, 128, 3072]),
    # Humming: the oracle's 64, but its weight preparation keeps 128s
    ("mxfp4", "humming", [384, 256, 128, 128, 128, 3072]),
    # the compressed-tensors MXFP4 method picks its kernel from the device
    # (CUTLASS here): 128-row scale tiles
    ("ct-mxfp4", "marlin", [384, 256, 128, 128, 128, 3072]),
    # FP8 block [128, 128]: whole checkpoint blocks per rank
    ("fp8-block", "triton", [384, 256, 128, 128, 128, 3072]),
    ("fp8-block", "marlin", [384, 256, 128, 128, 128, 3072]),
    ("fp8-block", "humming", [384, 256, 128, 128, 128, 3072]),
    # NVFP4: what the kernel keeps once its weight preparation padded the
    # logical slice (FlashInfer, b12x, Marlin: 64s; Humming: 128s)
    ("nvfp4", "flashinfer_cutedsl", [384, 192, 128, 128, 128, 3072]),
    ("nvfp4", "flashinfer_trtllm", [384, 192, 128, 128, 128, 3072]),
    ("nvfp4", "marlin", [384, 192, 128, 128, 128, 3072]),
    ("nvfp4", "humming", [384, 256, 128, 128, 128, 3072]),
    ("nvfp4", "emulation", [384, 192, 128, 96, 96, 3072]),
    # ... but vLLM's CUTLASS weight prep refuses to pad w13: 2N % 128
    ("nvfp4", "cutlass", [384, 192, 128, 128, 128, 3072]),
    ("modelopt-nvfp4", "flashinfer_cutedsl", [384, 192, 128, 128, 128, 3072]),
    ("modelopt-nvfp4", "cutlass", [384, 192, 128, 128, 128, 3072]),
    # INT4 W4A16: groups of 32; what Marlin (64s) and Humming (128s) keep
    ("w4a16", "marlin", [384, 192, 128, 128, 128, 3072]),
    ("w4a16", "humming", [384, 256, 128, 128, 128, 3072]),
    # AutoAWQ, AutoGPTQ: groups of 128, whole ones per rank (192 -> 256)
    ("awq", "marlin", [384, 256, 128, 128, 128, 3072]),
    ("gptq", "marlin", [384, 256, 128, 128, 128, 3072]),
    # BF16: Triton takes any size
    ("bf16", "triton", [384, 192, 128, 96, 96, 3072]),
    # no format: the rule learned from the method (FP8 per channel: 1 row)
    (LEARNED_FORMAT, "triton", [384, 192, 128, 96, 96, 3072]),
]


@pytest.mark.parametrize(("fmt", "backend", "partitions"), PARTITIONS)
def test_partition_per_format(outcome, fmt, backend, partitions):
    assert [outcome(fmt, backend, t) for t in ALIGNED_TOPOLOGIES] == partitions
    vllm_alone = [outcome(fmt, backend, t, upstream=True) for t in ALIGNED_TOPOLOGIES]
    assert vllm_alone == [384, 256, 256, 256, 128, 3072]


def vllm_alone_allocates(format_experts, fmt, backend, topology, rows, kernel):
    """Whether vLLM alone, asked (through its own model-level minimum) for
    exactly ``rows`` per rank, builds the layer at that size on ``kernel``
    and its kernel keeps them as they are: its method's checks and rounding
    are the judges, and the rows its weight preparation keeps (the format's
    ``resident``, held to that preparation by ``tests/models/kimi_k3/
    preparation``)."""
    logical = 3072 // topology.tp_size
    minimum = 1 if rows == logical else rows
    try:
        experts = format_experts(
            fmt, backend, topology, upstream=True, min_partition=minimum
        )
    except Exception:
        return False
    method = experts.quant_method
    fmt = format_of_method(method)
    kept = resident(fmt.partition_rule, method, rows) if fmt else rows
    return experts.intermediate_size_per_partition == rows == kept and (
        kernel_of(method) == kernel
    )


# Kernels whose limit vLLM alone does not check when it builds the layer:
# NVFP4 on CUTLASS refuses a pad at weight prep
# (test_nvfp4_cutlass_weight_prep_refuses_a_pad), and the compressed-tensors
# MXFP4 method allocates what it is given (its kernels' limit is the MXFP4
# sizing oracle: test_compressed_tensors_mxfp4_padding).
CHECKED_AFTER_BUILD = {("nvfp4", "cutlass"), ("modelopt-nvfp4", "cutlass")}
CHECKED_AFTER_BUILD |= {("ct-mxfp4", backend) for _, backend, _ in PARTITIONS}


@pytest.mark.parametrize(
    ("fmt", "backend", "partitions"),
    [row for row in PARTITIONS if row[:2] not in CHECKED_AFTER_BUILD],
)
@pytest.mark.parametrize("tp_size", [16, 24, 32])
def test_partition_is_the_smallest_vllm_accepts(
    format_experts, fmt, backend, partitions, tp_size
):
    topology = Topology(tp_size)
    experts = format_experts(fmt, backend, topology)
    mine, kernel = (
        experts.intermediate_size_per_partition,
        kernel_of(experts.quant_method),
    )
    logical = 3072 // tp_size
    assert vllm_alone_allocates(format_experts, fmt, backend, topology, mine, kernel)
    smaller = [logical, *range((logical // 16 + 1) * 16, mine, 16)]
    accepted = [
        rows
        for rows in smaller
        if rows < mine
        and vllm_alone_allocates(format_experts, fmt, backend, topology, rows, kernel)
    ]
    assert accepted == [], f"{fmt} on {backend} at TP{tp_size} also takes {accepted}"
