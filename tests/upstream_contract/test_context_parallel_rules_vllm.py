"""The context-parallel rules ``validate_topology`` and the command line
restate from vLLM 0.33.0, held to vLLM: DCP sizes as its ``ParallelConfig``
accepts them for Kimi-K3 (and every NVIDIA MLA backend takes DCP), and
prefill context parallelism refused as Kimi-K3's MLA layer refuses it when
vLLM builds the model. A contract with vLLM: at a vLLM bump, a failure here
says what changed."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import (
    KIMI_K3_PCP_REFUSAL,
    Deployment,
    DeploymentError,
    Serving,
    Topology,
    validate_prefill_context_parallel,
    validate_topology,
)
from vllm_kimi_k3_moe.tools.meta_rank.rank import rank_zero_of
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import whole_model_on_cpu
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    rank_vllm_config,
    write_model_dir,
)

TP_SIZES = [1, 2, 4, 8, 16, 32]  # every TP Kimi-K3's heads and vocabulary take
DCP_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64]


def refused(topology: Topology, rule: str) -> bool:
    try:
        validate_topology(KIMI_K3_TEXT_CONFIG, topology)
    except DeploymentError as error:
        return rule in str(error)
    return False


@pytest.fixture(scope="module")
def model_dir(kimi_model):
    with tempfile.TemporaryDirectory() as directory:
        yield write_model_dir(
            KIMI_K3_TEXT_CONFIG,
            mxfp4.RELEASE.published_quantization_config(),
            Serving(),
            Path(directory),
        )


@pytest.mark.parametrize("tp", TP_SIZES)
def test_dcp_sizes_as_vllm_accepts_them(model_dir, tp):
    """vLLM's ``ParallelConfig`` validator refuses a DCP size that does not
    divide TP; what it accepts, Kimi-K3's model config accepts too (its
    DCP head rules are for GQA models; Kimi-K3 is MLA)."""
    from pydantic import ValidationError
    from vllm.config import ModelConfig, ParallelConfig

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True)
    assert model_config.use_mla
    for dcp in DCP_SIZES:
        try:
            parallel = ParallelConfig(
                tensor_parallel_size=tp, decode_context_parallel_size=dcp
            )
        except ValidationError as error:
            assert "divisible by dcp_size" in str(error)
            parallel = None
        else:
            model_config.verify_with_parallel_config(parallel)
        assert refused(Topology(tp, dcp_size=dcp), "decode-context") == (
            parallel is None
        ), (tp, dcp)


# Dense MLA backends vLLM's CUDA platform picks from for Kimi-K3 (Blackwell's
# first choice FlashInfer MLA, FlashMLA, Triton MLA, TokenSpeed MLA) that
# import on a CPU box (CUTLASS MLA and FlashAttention MLA need the GPU's
# libraries to import).
MLA_BACKENDS = ["FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA", "TOKENSPEED_MLA"]


@pytest.mark.parametrize("name", MLA_BACKENDS)
def test_nvidia_mla_backends_take_dcp(kimi_model, name):
    """Each supports DCP (vLLM's backend selection drops one that does not)
    and returns the softmax LSE DCP combines (``check_attention_cp_
    compatibility``): no backend adds a DCP rule of its own."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum[name].get_class()
    assert backend.supports_dcp()
    assert backend.get_impl_cls().can_return_lse_for_decode


def build_with_pcp(model_dir: Path, pcp: int):
    """vLLM's Kimi-K3 model for rank 0 of TP8 on ``meta``, under a
    ``VllmConfig`` asking for ``--prefill-context-parallel-size pcp``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia import model as model_module

    deployment = Deployment(8)
    with rank_zero_of(deployment), whole_model_on_cpu():
        vllm_config = rank_vllm_config(model_dir, deployment, "marlin", Serving())
        vllm_config.parallel_config = replace(
            vllm_config.parallel_config, prefill_context_parallel_size=pcp
        )
        with set_current_vllm_config(vllm_config), torch.device("meta"):
            return model_module.KimiK3ForConditionalGeneration(
                vllm_config=vllm_config, prefix=""
            )


def test_vllm_builds_kimi_k3_without_pcp_only(model_dir):
    """vLLM's config takes PCP 2 at TP8; building Kimi-K3 then stops in its
    MLA layer with the assertion the tool quotes."""
    with pytest.raises(AssertionError) as refusal:
        build_with_pcp(model_dir, 2)
    assert str(refusal.value) == KIMI_K3_PCP_REFUSAL
    with pytest.raises(DeploymentError, match=KIMI_K3_PCP_REFUSAL):
        validate_prefill_context_parallel(2)
    validate_prefill_context_parallel(1)
