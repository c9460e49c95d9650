"""vLLM's real Kimi-K3 language model builds for one rank on the meta device,
upstream and with the plugin, and its per-GPU bytes add up by component."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import upstream_kimi_moe
from vllm_kimi_k3_moe.tools.build import stand_ins as cpu_stand_ins
from vllm_kimi_k3_moe.tools.build.rank import Topology, simulated_rank
from vllm_kimi_k3_moe.tools.build.whole_model import (
    COMPONENTS,
    build_rank,
    kimi_moe_class,
    write_architecture,
)
from vllm_kimi_k3_moe.tools.plan.planner import plan
from vllm_kimi_k3_moe.tools.text_config import (
    KIMI_K3_MOE_TEXT_CONFIG,
    KIMI_K3_TEXT_CONFIG,
)
from vllm_kimi_k3_moe.tools.topology import Deployment, Serving

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


@pytest.mark.parametrize("upstream", [False, True])
def test_the_language_model_builds_at_tp32_rank0_on_meta(kimi_model, upstream):
    fixed_cls = kimi_model.KimiMoE
    kimi_moe_cls = upstream_kimi_moe(kimi_model) if upstream else fixed_cls
    deployment, serving = Deployment(32), Serving()
    with tempfile.TemporaryDirectory() as directory:
        architecture = write_architecture(
            KIMI_K3_TEXT_CONFIG, deployment, serving, Path(directory)
        )
        model = build_rank(
            kimi_moe_cls, KIMI_K3_TEXT_CONFIG, deployment, serving, architecture
        ).model
    assert type(model) is kimi_model.KimiLinearForCausalLM
    assert kimi_model.KimiMoE is fixed_cls  # the swap was undone
    assert all(p.device.type == "meta" for p in model.parameters())
    layers = model.model.layers
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
def test_routed_experts_are_the_planners_times_the_moe_layers(sizes, tp):
    moe_plan = plan(KIMI_K3_MOE_TEXT_CONFIG, Deployment(tp))
    size = sizes[tp]
    assert size.moe.moe_layers == MOE_LAYERS
    assert size.moe.upstream == moe_plan.upstream  # its first MoE layer
    assert size.moe.fixed == moe_plan.fixed
    routed = "moe_routed_experts"
    assert size.upstream.components[routed] == moe_plan.upstream.routed_bytes * 92
    assert size.fixed.components[routed] == moe_plan.fixed.routed_bytes * 92


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


def test_every_component_is_counted(sizes):
    for allocation in (sizes[32].upstream, sizes[32].fixed):
        assert set(allocation.components) == set(COMPONENTS)
        assert all(n > 0 for n in allocation.components.values())
        assert allocation.total_bytes == sum(allocation.components.values())


def _state(kimi_model) -> dict[str, object]:
    """Everything the whole-model stand-ins replace."""
    from vllm.distributed import parallel_state
    from vllm.models.kimi_k3.nvidia import mla

    return {
        "Stream": torch.cuda.Stream,
        "Event": torch.cuda.Event,
        "get_attn_backend": mla.get_attn_backend,
        "get_mla_prefill_backend": mla.get_mla_prefill_backend,
        "KimiMoE": kimi_model.KimiMoE,
        "_PP": parallel_state._PP,
    }


def test_stand_ins_are_entered_and_left(kimi_model):
    from vllm.models.kimi_k3.nvidia import mla

    before = _state(kimi_model)
    upstream = upstream_kimi_moe(kimi_model)
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


def test_stand_ins_hold_no_parameters():
    for stand_in in (
        cpu_stand_ins.CudaStreamStandIn(),
        cpu_stand_ins.MlaKernelStandIn(num_heads=3, head_size=576),
    ):
        assert not isinstance(stand_in, torch.nn.Module)
        assert not any(isinstance(v, torch.Tensor) for v in vars(stand_in).values())
