"""vLLM's CUTLASS MoE kernels: NVFP4 (``CutlassExpertsFp4``), compressed-
tensors MXFP4 (``CutlassExpertsMxfp4``, which the method picks from the GPU
alone: ``--moe-backend cutlass`` here stands for a Blackwell GPU) and
compressed-tensors FP8 per output channel (``CutlassExpertsFp8`` inside
``TritonOrCutlassExperts``). vLLM's own weight preparation, run on the CPU
at every layout the plugin gives each config, hands the kernel what it
assumes: the loaded weights unchanged with zero pads, block scales whole
128 x 4 tiles per expert read back as loaded (``fp4_kernels``), FP8's
per-channel scales one per output row, the GEMMs' K whole multiples of the
operand alignment, finite everything it reads, and no more rows than the
plugin allocated.

The configs of the never-worse matrix on these kernels: NVFP4 (compressed-
tensors, ModelOpt), compressed-tensors MXFP4, and FP8 per channel: FP8 per
tensor has dynamic per-tensor activations there, which CUTLASS refuses
(``kFp8Dynamic128Sym``), and FP8 blocks have no CUTLASS MoE kernel in
vLLM 0.33.0.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.kimi_k3.preparation.fp4_kernels import UNPADDED, Fp4Gemm
from tests.models.kimi_k3.preparation.harness import (
    PreparedRank,
    assert_prepared_right,
    layouts_on,
)
from tests.models.kimi_k3.preparation.kernel_reads import (
    E4M3_NAN_BYTES,
    E8M0_NAN_BYTES,
    kernel_tensors,
    nonfinite,
)

# Elements per 128-bit access of the A and B operands along K: 32 FP4 values
# (mxfp4_blockwise_moe_kernel.cu, nvfp4_blockwise_moe_kernel.cu:
# ``AlignmentA = 32``), 16 FP8 values (grouped_mm_c3x.cuh: ``AlignmentAB =
# 128 / sizeof_bits<ElementAB>``).
K_ALIGNMENT = {"nvfp4": 32, "mxfp4": 32, "fp8": 16}
GROUP = {"nvfp4": 16, "mxfp4": 32}
NAN_BYTES = {"nvfp4": E4M3_NAN_BYTES, "mxfp4": E8M0_NAN_BYTES}

PAIRS = [
    ("nvfp4", "nvfp4", "cutlass"),
    ("modelopt-nvfp4", "nvfp4", "cutlass"),
    ("ct-mxfp4", "mxfp4", "cutlass"),
    ("ct-fp8-channel", "fp8", "cutlass"),
]


def loaded(prepared: PreparedRank, name: str) -> torch.Tensor:
    """A loaded parameter (compressed-tensors' packed weights under their
    own name)."""
    tensors = prepared.loaded
    return tensors.get(f"{name}_packed", tensors.get(name))


def fp4_gemms(prepared: PreparedRank, kind: str) -> list[Fp4Gemm]:
    """The two FP4 GEMMs as the kernel reads them: [gate; up] as loaded,
    scales stepped per expert by the unpadded size."""
    experts = prepared.experts
    nan = NAN_BYTES[kind]
    return [
        Fp4Gemm(
            name,
            getattr(experts, f"{name}_weight"),
            getattr(experts, f"{name}_weight_scale"),
            loaded(prepared, f"{name}_weight").view(torch.uint8),
            loaded(prepared, f"{name}_weight_scale").view(torch.uint8),
            UNPADDED,
            nan,
        )
        for name in ("w13", "w2")
    ]


def fp8_problems(prepared: PreparedRank) -> list[str]:
    """Weights and per-channel scales as loaded; the kernel takes the scales
    as one per output row of each expert (get_group_starts.cuh:
    ``per_out_ch = b_scales.numel() != num_experts``, expert e's at
    ``n * e``)."""
    experts = prepared.experts
    found = []
    for name in ("w13", "w2"):
        weight = getattr(experts, f"{name}_weight")
        scale = getattr(experts, f"{name}_weight_scale")
        if not torch.equal(
            weight.view(torch.uint8),
            loaded(prepared, f"{name}_weight").view(torch.uint8),
        ):
            found.append(f"{name}: weights are not the loaded ones")
        if not torch.equal(scale, loaded(prepared, f"{name}_weight_scale")):
            found.append(f"{name}: scales are not the loaded ones")
        experts_, rows = weight.shape[:2]
        if scale.numel() != experts_ * rows or not scale.is_contiguous():
            found.append(f"{name}: scales {tuple(scale.shape)} are not one per row")
    return found


def pads_loaded_zero(prepared: PreparedRank) -> list[str]:
    """The rows past those this GPU holds load as zero weights."""
    held = prepared.case.rows
    gate, up = loaded(prepared, "w13_weight").view(torch.uint8).chunk(2, dim=1)
    w2 = loaded(prepared, "w2_weight").view(torch.uint8)
    per_byte = 2 if loaded(prepared, "w2_weight").dtype == torch.uint8 else 1
    found = []
    if bool(gate[:, held:].any() or up[:, held:].any()):
        found.append(f"w13: rows past the {held} held are not zero")
    if bool(w2[..., held // per_byte :].any()):
        found.append(f"w2: columns past the {held} rows held are not zero")
    return found


def problems_of(prepared: PreparedRank, kind: str) -> list[str]:
    experts = prepared.experts
    rows = experts.w13_weight.shape[1] // 2
    found = []
    if kind == "fp8":
        found += fp8_problems(prepared)
    else:
        for gemm in fp4_gemms(prepared, kind):
            found += gemm.problems()
    for gemm, k in (("w13", prepared.width), ("w2", rows)):
        if k % K_ALIGNMENT[kind]:
            found.append(f"{gemm}: K {k} is not a multiple of {K_ALIGNMENT[kind]}")
    found += pads_loaded_zero(prepared)
    if rows != prepared.choice.allocated:
        found.append(f"preparation re-pads {prepared.choice.allocated} rows to {rows}")
    told = experts.moe_config.intermediate_size_per_partition
    if told != prepared.choice.allocated:
        found.append(f"moe_config's partition rewritten to {told}")
    coded = {}
    if kind in NAN_BYTES:
        coded = {
            experts.w13_weight_scale: NAN_BYTES[kind],
            experts.w2_weight_scale: NAN_BYTES[kind],
        }
    bad = nonfinite(kernel_tensors(experts), coded)
    if bad:
        found.append(f"NaN or Inf in {', '.join(bad)}")
    return [f"{prepared.case.label()}: {problem}" for problem in found]


@pytest.mark.parametrize(("config", "kind", "backend"), PAIRS)
def test_cutlass_preparation_is_what_the_kernel_reads(
    kimi_model, format_experts, config, kind, backend, one_cpu_thread
):
    assert_prepared_right(
        kimi_model,
        layouts_on(format_experts, config, backend),
        lambda prepared: problems_of(prepared, kind),
    )
