"""FlashInfer's TRT-LLM and CuteDSL MoE kernels (NVFP4, and native MXFP4 on
TRT-LLM) and b12x's NVFP4 kernel: vLLM's own weight preparation, run on the
CPU at every layout the plugin gives each config, hands the kernel what it
assumes (``fp4_kernels``): the loaded weights and scales in the kernel's row
order with zero pads, its 128 x 4 scale tiles whole where it steps over
experts by the unpadded size, finite everything it reads, and no more rows
than the plugin allocated (the TRT-LLM and CuteDSL preparations pad to 64
rows and rewrite ``moe_config`` when they do; b12x pads without telling it).

The configs of the never-worse matrix these kernels take: NVFP4 (compressed-
tensors and ModelOpt: each method prepares its own parameters, then both
call ``convert_to_nvfp4_moe_kernel_format``) and native MXFP4 (TRT-LLM and
b12x only). b12x's MXFP4 preparation is not run: vLLM hands b12x the
loaded tensors as they are (``convert_weight_to_mxfp4_moe_kernel_format``),
and b12x's W4A8 repack (``_logical_weight_to_w4a8_rp_inplace``, a Triton
kernel) runs on a CPU only for whole 256 x 128 tiles, not at 96 rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.kimi_k3.preparation.fp4_kernels import (
    PADDED,
    UNPADDED,
    Fp4Gemm,
    cutedsl_gemm1_rows,
    trtllm_gemm1_rows,
    trtllm_rows,
)
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

NVFP4_GROUP, MXFP4_GROUP = 16, 32
# The TRT-LLM NVFP4 cubins' hidden alignment for a gated activation
# (flashinfer_utils.trtllm_nvfp4_hidden_alignment); CuteDSL's GEMM1 "gathers
# full 256-element K tiles ... without a K-tail predicate"
# (prepare_nvfp4_moe_layer_for_flashinfer_cutedsl).
HIDDEN_ALIGNMENT = 256

PAIRS = [
    ("nvfp4", "flashinfer_trtllm"),
    ("modelopt-nvfp4", "flashinfer_trtllm"),
    ("mxfp4", "flashinfer_trtllm"),
    ("nvfp4", "flashinfer_cutedsl"),
    ("modelopt-nvfp4", "flashinfer_cutedsl"),
    ("nvfp4", "b12x"),
    ("modelopt-nvfp4", "b12x"),
]


def loaded(prepared: PreparedRank, name: str) -> torch.Tensor:
    """A loaded parameter as bytes (compressed-tensors' packed weights
    under their own name)."""
    tensors = prepared.loaded
    return tensors.get(f"{name}_packed", tensors.get(name)).view(torch.uint8)


def halves(w13: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up, each zero-padded to ``rows``."""
    gate, up = w13.chunk(2, dim=1)
    pad = (0, 0, 0, rows - gate.shape[1])
    return F.pad(gate, pad), F.pad(up, pad)


def up_gate(w13: torch.Tensor, rows: int) -> torch.Tensor:
    gate, up = halves(w13, rows)
    return torch.cat([up, gate], dim=1)


def gate_up(w13: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat(halves(w13, rows), dim=1)


def unsigned_zeros(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 with each -0 (code 0b1000) written +0: b12x clears the sign
    of zeros in place (``_canonicalize_fp4_zero_signs_``), the same values."""
    low, high = packed & 0x0F, packed >> 4
    low = torch.where(low == 0x8, 0, low)
    high = torch.where(high == 0x8, 0, high)
    return (high << 4 | low).to(torch.uint8)


def pad_last(tensor: torch.Tensor, size: int) -> torch.Tensor:
    return F.pad(tensor, (0, size - tensor.shape[-1]))


def gemms(prepared: PreparedRank, backend: str, group: int) -> list[Fp4Gemm]:
    """The layer's two GEMMs as ``backend``'s kernel reads them."""
    experts = prepared.experts
    rows = experts.w2_weight.shape[2] * 2  # what the kernel runs
    width = prepared.width
    w13, s13 = loaded(prepared, "w13_weight"), loaded(prepared, "w13_weight_scale")
    w2 = pad_last(loaded(prepared, "w2_weight"), rows // 2)
    s2 = pad_last(loaded(prepared, "w2_weight_scale"), rows // group)
    nan = E8M0_NAN_BYTES if group == MXFP4_GROUP else E4M3_NAN_BYTES
    if backend == "flashinfer_trtllm":
        order = trtllm_gemm1_rows(2 * rows)
        w13, s13 = up_gate(w13, rows)[:, order], up_gate(s13, rows)[:, order]
        w2, s2 = w2[:, trtllm_rows(width)], s2[:, trtllm_rows(width)]
        steps = UNPADDED
    elif backend == "flashinfer_cutedsl":
        order = cutedsl_gemm1_rows(2 * rows).reshape(-1)
        w13, s13 = up_gate(w13, rows)[:, order], up_gate(s13, rows)[:, order]
        steps = PADDED
    else:  # b12x: gate first, as loaded, FP4 zeros unsigned
        w13, s13 = unsigned_zeros(gate_up(w13, rows)), gate_up(s13, rows)
        w2 = unsigned_zeros(w2)
        steps = PADDED
    return [
        Fp4Gemm(
            "w13", experts.w13_weight, experts.w13_weight_scale, w13, s13, steps, nan
        ),
        Fp4Gemm("w2", experts.w2_weight, experts.w2_weight_scale, w2, s2, steps, nan),
    ]


def pads_loaded_zero(prepared: PreparedRank) -> list[str]:
    """The rows past those this GPU holds load as zero weights (GPUs of
    whole groups holding none: all of them), so they add nothing whatever
    their scales (vLLM's block-aligned loader gives an empty GPU's scales 1:
    finite, which ``nonfinite`` checks)."""
    held = prepared.case.rows
    gate, up = loaded(prepared, "w13_weight").chunk(2, dim=1)
    w2 = loaded(prepared, "w2_weight")
    found = []
    if bool(gate[:, held:].any() or up[:, held:].any()):
        found.append(f"w13: rows past the {held} held are not zero")
    if bool(w2[..., held // 2 :].any()):
        found.append(f"w2: columns past the {held} rows held are not zero")
    return found


def kernel_size_problems(prepared: PreparedRank, backend: str, group: int) -> list:
    """The sizes the kernel is told, against the prepared tensors."""
    experts = prepared.experts
    rows = experts.w2_weight.shape[2] * 2
    width = prepared.width
    found = []
    if width % HIDDEN_ALIGNMENT and backend != "b12x":
        found.append(f"width {width} is not a multiple of {HIDDEN_ALIGNMENT}")
    config = experts.moe_config
    if config.hidden_dim != width:
        found.append(f"moe_config.hidden_dim rewritten to {config.hidden_dim}")
    if backend == "flashinfer_trtllm":
        told = experts.quant_method.moe_kernel.fused_experts
        if told.intermediate_size_per_partition != rows:
            found.append(
                f"the kernel is told {told.intermediate_size_per_partition} "
                f"rows, the weights hold {rows}"
            )
        # trtllm_fp4_block_scale_moe: the scale vector from the scale count
        scales = experts.w13_weight_scale.numel()
        inferred = (
            32 if experts.w13_weight.shape[0] * rows * 2 * width // scales > 16 else 16
        )
        if inferred != group:
            found.append(f"the kernel infers scales per {inferred}, not {group}")
    if backend == "b12x":  # b12x keeps the layer's tensors, not a copy
        kept = experts._b12x_prepared_experts
        if kept.w1_fp4.data_ptr() != experts.w13_weight.data_ptr():
            found.append("b12x keeps a second copy of w13")
        if kept.w2_fp4.data_ptr() != experts.w2_weight.data_ptr():
            found.append("b12x keeps a second copy of w2")
    return found


def problems_of(prepared: PreparedRank, backend: str) -> list[str]:
    experts = prepared.experts
    group = (
        MXFP4_GROUP if "Mxfp4" in type(experts.quant_method).__name__ else NVFP4_GROUP
    )
    found = []
    for gemm in gemms(prepared, backend, group):
        found += gemm.problems()
    found += pads_loaded_zero(prepared)
    found += kernel_size_problems(prepared, backend, group)
    rows = experts.w2_weight.shape[2] * 2
    if rows != prepared.choice.allocated:
        found.append(
            f"preparation re-pads {prepared.choice.allocated} rows to {rows}: "
            f"{rows} resident, a second copy while it pads"
        )
    told = experts.moe_config.intermediate_size_per_partition
    if told != prepared.choice.allocated:
        found.append(f"moe_config's partition rewritten to {told}")
    nan = E8M0_NAN_BYTES if group == MXFP4_GROUP else E4M3_NAN_BYTES
    coded = {experts.w13_weight_scale: nan, experts.w2_weight_scale: nan}
    bad = nonfinite(kernel_tensors(experts), coded)
    if bad:
        found.append(f"NaN or Inf in {', '.join(bad)}")
    return [f"{prepared.case.label()}: {problem}" for problem in found]


@pytest.mark.parametrize(("config", "backend"), PAIRS)
def test_flashinfer_preparation_is_what_the_kernel_reads(
    kimi_model, format_experts, config, backend, one_cpu_thread
):
    assert_prepared_right(
        kimi_model,
        layouts_on(format_experts, config, backend),
        lambda prepared: problems_of(prepared, backend),
    )
