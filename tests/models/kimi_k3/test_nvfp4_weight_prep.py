"""vLLM's NVFP4 weight preparation decides the final partition: the CUTLASS
kernels refuse a gated pad, the FlashInfer kernels pad the logical 96 to 128
into new tensors; either way the plugin allocates the 128 they keep."""

from __future__ import annotations

import pytest
import torch

from vllm_kimi_k3_moe.tools.deployment.topology import Topology

TP_SIZE = 32


@pytest.fixture
def cuda_copies_stay_on_cpu(monkeypatch):
    """``swizzle_blockscale`` ends with ``.cuda()``: the one step of vLLM's
    weight preparation that needs a GPU. Here it leaves the tensor where it
    is; every shape decision before it is vLLM's."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def prepare(experts, backend_name: str):
    """Run vLLM's NVFP4 conversion to the kernel format on a ModelOpt layer."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4

    for param in experts.parameters():
        if param.dtype == torch.uint8:
            param.data.copy_(torch.randint_like(param, 1, 255))
        elif param.dtype == torch.float8_e4m3fn:
            param.data.copy_(torch.ones_like(param, dtype=torch.float32))
        else:
            param.data.fill_(0.5)
    return nvfp4.convert_to_nvfp4_moe_kernel_format(
        nvfp4_backend=nvfp4.NvFp4MoeBackend[backend_name],
        layer=experts,
        w13=experts.w13_weight.data,
        w13_scale=experts.w13_weight_scale.data,
        w13_scale_2=experts.w13_weight_scale_2[:, 0].contiguous(),
        a13_scale=experts.w13_input_scale.data,
        w2=experts.w2_weight.data,
        w2_scale=experts.w2_weight_scale.data,
        w2_scale_2=experts.w2_weight_scale_2.data,
        a2_scale=experts.w2_input_scale.data,
        is_act_and_mul=True,
    )


def build(format_experts, backend, **kwargs):
    return format_experts(
        "modelopt-nvfp4", backend, Topology(TP_SIZE), small=True, device="cpu", **kwargs
    )


def test_cutlass_weight_prep_refuses_the_logical_96(
    format_experts, cuda_copies_stay_on_cpu
):
    """The limit behind the plugin's 128: vLLM alone handed exactly 96 rows
    builds, then fails to prepare them."""
    experts = build(format_experts, "cutlass", upstream=True, min_partition=1)
    assert experts.intermediate_size_per_partition == 96
    with pytest.raises(NotImplementedError, match="Intermediate size padding"):
        prepare(experts, "VLLM_CUTLASS")


def test_cutlass_weight_prep_takes_the_plugin_partition(
    format_experts, cuda_copies_stay_on_cpu
):
    experts = build(format_experts, "cutlass")
    assert experts.intermediate_size_per_partition == 128
    w13, _, _, _, w2, _, _, _ = prepare(experts, "VLLM_CUTLASS")
    assert w13.shape[1] == 2 * 128 and w2.shape[2] * 2 == 128


def test_flashinfer_weight_prep_pads_the_logical_96_again(
    format_experts, cuda_copies_stay_on_cpu
):
    """Why the plugin allocates 128 on FlashInfer too: handed the logical 96
    (vLLM alone at TP8 x DP4), its weight preparation pads each of gate and
    up to 128 into new tensors (``align_fp4_moe_weights_for_fi``; the 32 new
    rows, interleaved with the others by the kernel layout, and the new w2
    columns all zero), and the layer keeps those."""
    experts = build(
        format_experts, "flashinfer_cutedsl", upstream=True, min_partition=1
    )
    assert experts.intermediate_size_per_partition == 96
    w13, _, _, _, w2, _, _, _ = prepare(experts, "FLASHINFER_CUTEDSL")
    assert experts.moe_config.intermediate_size_per_partition == 128
    assert w13.shape[1] == 2 * 128 and w2.shape[2] * 2 == 128
    # every loaded byte is non-zero (prepare's random 1..254)
    zero_rows = (w13 == 0).all(dim=2)
    assert bool((zero_rows.sum(dim=1) == 2 * 32).all())
    assert bool((w13[~zero_rows] != 0).all())
    assert w2[..., : 96 // 2].all() and not w2[..., 96 // 2 :].any()


def test_flashinfer_weight_prep_keeps_the_plugin_partition(
    format_experts, cuda_copies_stay_on_cpu
):
    experts = build(format_experts, "flashinfer_cutedsl")
    assert experts.intermediate_size_per_partition == 128
    w13, _, _, _, w2, _, _, _ = prepare(experts, "FLASHINFER_CUTEDSL")
    assert experts.moe_config.intermediate_size_per_partition == 128
    assert w13.shape[1] == 2 * 128 and w2.shape[2] * 2 == 128
