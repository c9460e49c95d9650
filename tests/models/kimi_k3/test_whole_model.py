"""vLLM's real Kimi-K3 language model builds for one rank on the meta device,
upstream and with the plugin, and its per-GPU bytes add up by component."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank import stand_ins as cpu_stand_ins
from vllm_kimi_k3_moe.tools.meta_rank.allocation import COMPONENTS
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    write_model_dir,
)
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import (
    RankBuild,
    build_rank,
    kimi_moe_class,
)

VOCAB = 163840
HIDDEN = 7168
BF16 = 2  # bytes
LAYERS = 93
MOE_LAYERS = 92  # layer 0 is dense
MLA_LAYERS = 24  # 1-based 4, 8, ..., 92 and 93
KDA_LAYERS = 69


@pytest.fixture(scope="module")
def sizes(kimi_k3_deployment_plans) -> dict[int, object]:
    return kimi_k3_deployment_plans


def build_tp32(kimi_moe_cls: type) -> RankBuild:
    deployment, serving = Deployment(32), Serving()
    with tempfile.TemporaryDirectory() as directory:
        model_dir = write_model_dir(
            KIMI_K3_TEXT_CONFIG,
            mxfp4.RELEASE.published_quantization_config(),
            serving,
            Path(directory),
        )
        return build_rank(
            kimi_moe_cls, KIMI_K3_TEXT_CONFIG, deployment, serving, model_dir
        )


@pytest.fixture(scope="module")
def tp32_fixed(kimi_model) -> RankBuild:
    return build_tp32(kimi_model.KimiMoE)


@pytest.mark.parametrize("upstream", [False, True])
def test_the_model_vllm_serves_builds_at_tp32_rank0_on_meta(
    kimi_model, tp32_fixed, upstream
):
    fixed_cls = kimi_model.KimiMoE
    kimi_moe_cls = upstream_class(kimi_model.KimiMoE) if upstream else fixed_cls
    model = build_tp32(kimi_moe_cls).model if upstream else tp32_fixed.model
    assert type(model) is kimi_model.KimiK3ForConditionalGeneration
    assert type(model.language_model) is kimi_model.KimiLinearForCausalLM
    assert kimi_model.KimiMoE is fixed_cls  # the swap was undone
    assert all(p.device.type == "meta" for p in model.parameters())
    layers = model.language_model.model.layers
    assert len(layers) == LAYERS
    moe = [layer.mlp for layer in layers if layer.is_moe_layer]
    assert len(moe) == MOE_LAYERS
    assert all(type(m) is kimi_moe_cls for m in moe)
    attention = [type(layer.self_attn).__name__ for layer in layers]
    assert attention.count("MultiHeadLatentAttention") == MLA_LAYERS
    assert attention.count("KimiK3DeltaAttention") == KDA_LAYERS
    # 0-based 3 and 92 are MLA (1-based 4 and 93), 0-based 0 is KDA
    assert type(layers[3].self_attn).__name__ == "MultiHeadLatentAttention"
    assert type(layers[92].self_attn).__name__ == "MultiHeadLatentAttention"
    assert type(layers[0].self_attn).__name__ == "KimiK3DeltaAttention"


@pytest.mark.parametrize("tp", [8, 32])
@pytest.mark.parametrize("upstream", [False, True])
def test_routed_experts_are_one_layer_built_alone_times_the_moe_layers(
    sizes, build_kimi_moe, tp, upstream
):
    """The plan's routed experts equal a ``KimiMoE`` built on its own (native
    MXFP4 on Marlin, the tests' own build) times the 92 MoE layers."""
    layer = build_kimi_moe(Topology(tp), upstream=upstream)
    routed_bytes = sum(
        p.numel() * p.element_size()
        for name, p in layer.named_parameters()
        if name.startswith(
            ("experts.routed_experts.w13_", "experts.routed_experts.w2_")
        )
    )
    size = sizes[tp]
    assert size.moe.moe_layers == MOE_LAYERS
    allocation = size.upstream if upstream else size.fixed
    assert allocation.components["moe_routed_experts"] == routed_bytes * MOE_LAYERS


def test_the_plugin_shrinks_the_model_at_tp32_only(sizes):
    assert sizes[32].fixed.total_bytes < sizes[32].upstream.total_bytes
    assert sizes[8].fixed == sizes[8].upstream
    # only the routed experts differ
    for component in COMPONENTS:
        if component != "moe_routed_experts":
            assert (
                sizes[32].fixed.components[component]
                == sizes[32].upstream.components[component]
            )


@pytest.mark.parametrize(
    ("tp", "embedding_bytes"),
    [
        (8, 293_601_280),  # 163840 / 8 = 20480 rows x 7168 x 2 bytes
        (32, 73_400_320),  # 163840 / 32 = 5120 rows x 7168 x 2 bytes
    ],
)
def test_embeddings_and_lm_head_are_a_vocab_slice_in_bf16(sizes, tp, embedding_bytes):
    assert VOCAB // tp * HIDDEN * BF16 == embedding_bytes
    for allocation in (sizes[tp].upstream, sizes[tp].fixed):
        assert allocation.components["embeddings"] == embedding_bytes
        assert allocation.components["lm_head"] == embedding_bytes  # not tied


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_components_add_up_by_module_structure(kimi_model, tp32_fixed):
    """The components, summed here from the model's module tree (not from
    parameter names, as the planner does), and the total."""
    model = tp32_fixed.model.language_model
    layers = model.model.layers
    attention = {"mla_attention": 0, "kda_attention": 0}
    routed = moe_other = dense = 0
    for layer in layers:
        kind = type(layer.self_attn).__name__
        key = "mla_attention" if kind == "MultiHeadLatentAttention" else "kda_attention"
        attention[key] += _bytes(layer.self_attn)
        if layer.is_moe_layer:
            experts = layer.mlp.experts.routed_experts
            routed += sum(
                p.numel() * p.element_size()
                for name, p in experts.named_parameters()
                if name.startswith(("w13_", "w2_"))
            )
            moe_other += _bytes(layer.mlp)
        else:
            dense += _bytes(layer.mlp)
    moe_other -= routed
    expected = {
        "embeddings": _bytes(model.model.embed_tokens),
        "lm_head": _bytes(model.lm_head),
        **attention,
        "dense_mlp": dense,
        "moe_routed_experts": routed,
        "moe_other": moe_other,
        "vision_tower": _bytes(tp32_fixed.model.vision_tower)
        + _bytes(tp32_fixed.model.mm_projector),
    }
    components = tp32_fixed.allocation.components
    assert {k: components[k] for k in expected} == expected
    assert tp32_fixed.allocation.total_bytes == _bytes(tp32_fixed.model)
    assert set(components) == set(COMPONENTS)


def test_every_parameter_belongs_to_a_vllm_module(tp32_fixed):
    """Nothing the CPU stand-ins put in the model holds a parameter: every
    parameter's owner is a module class of vLLM's (or a torch.nn module
    vLLM's vision tower builds), none of this package's."""
    owners = {
        type(module).__module__
        for module in tp32_fixed.model.modules()
        if any(True for _ in module.parameters(recurse=False))
    }
    assert owners and all(name.startswith(("vllm.", "torch.nn.")) for name in owners), (
        owners
    )
    assert any(name.startswith("vllm.") for name in owners)


def _state(kimi_model) -> dict[str, object]:
    """Everything the whole-model stand-ins replace."""
    from vllm.distributed import parallel_state
    from vllm.models.kimi_k3.nvidia import mla
    from vllm.platforms import current_platform

    return {
        "Stream": torch.cuda.Stream,
        "Event": torch.cuda.Event,
        "get_attn_backend": mla.get_attn_backend,
        "get_mla_prefill_backend": mla.get_mla_prefill_backend,
        "KimiMoE": kimi_model.KimiMoE,
        "_PP": parallel_state._PP,
        "current_device": vars(current_platform).get("current_device"),
    }


def test_stand_ins_are_entered_and_left(kimi_model):
    from vllm.models.kimi_k3.nvidia import mla

    before = _state(kimi_model)
    upstream = upstream_class(kimi_model.KimiMoE)
    with cpu_stand_ins.cuda_streams_and_events():
        assert torch.cuda.Stream is cpu_stand_ins.CudaStreamStandIn
        assert torch.cuda.Event is cpu_stand_ins.CudaStreamStandIn
        torch.cuda.Stream(), torch.cuda.Event()
    assert _state(kimi_model) == before
    with cpu_stand_ins.mla_attention_kernels():
        backend = mla.get_attn_backend(576, torch.bfloat16, "auto", use_mla=True)
        assert backend is cpu_stand_ins.mla_backend_stand_in()
        assert backend.get_impl_cls() is cpu_stand_ins.MlaKernelStandIn
        assert mla.get_mla_prefill_backend(None) is cpu_stand_ins.MlaKernelStandIn
    assert _state(kimi_model) == before
    with kimi_moe_class(kimi_model, upstream):
        assert kimi_model.KimiMoE is upstream
    assert _state(kimi_model) == before
    with simulated_rank(Topology(32)):
        from vllm.distributed import parallel_state

        assert parallel_state._PP.is_first_rank and parallel_state._PP.is_last_rank
    assert _state(kimi_model) == before
    with pytest.raises(RuntimeError), cpu_stand_ins.whole_model_on_cpu():
        assert torch.cuda.Stream is cpu_stand_ins.CudaStreamStandIn
        raise RuntimeError("left by an error")
    assert _state(kimi_model) == before
