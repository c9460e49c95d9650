"""``plan_deployment`` sizes the whole deployment: the KV cache from the specs
vLLM's built layers report (checked against hand arithmetic), what is left of a
GPU next to the weights, and every published format at TP8, TP16 and TP32."""

from __future__ import annotations

import math

import pytest

from vllm_kimi_k3_moe import compat
from vllm_kimi_k3_moe.formats import FORMAT_NAMES, format_named
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment
from vllm_kimi_k3_moe.tools.plan.planner import plan_deployment

MLA_LAYERS, KDA_LAYERS = 24, 69
KV_LORA_RANK, ROPE = 512, 64  # the MLA cache holds 576 values per token
KDA_HEADS, KDA_HEAD_DIM, CONV = 96, 128, 4
BF16, FP32 = 2, 4


def kda_state_bytes(tp: int) -> int:
    """One KDA layer's state per sequence on one GPU: the short convolution
    keeps CONV - 1 past inputs of q, k and v (bf16), the recurrence one
    128 x 128 matrix per head (fp32, vLLM's default for it)."""
    conv = (CONV - 1) * 3 * KDA_HEADS * KDA_HEAD_DIM // tp * BF16
    recurrent = KDA_HEADS // tp * KDA_HEAD_DIM * KDA_HEAD_DIM * FP32
    return conv + recurrent


@pytest.mark.parametrize(
    ("tp", "block_size"),
    [
        # a block holds a KDA state: 128-token multiples of 576 x 2 bytes
        (8, 768),  # 814,080 B of state -> 6 x 128 tokens
        (16, 384),
        (32, 256),  # 203,520 B -> 2 x 128 tokens (294,912 B)
    ],
)
def test_kv_cache_specs_match_hand_arithmetic(kimi_k3_deployment_plans, tp, block_size):
    kv = kimi_k3_deployment_plans[tp].kv_cache
    assert kv.mla_layers == MLA_LAYERS and kv.kda_layers == KDA_LAYERS
    # MLA's latent cache is not split by TP: every GPU holds all of it
    assert kv.mla_bytes_per_token == MLA_LAYERS * (KV_LORA_RANK + ROPE) * BF16
    assert kv.kda_bytes_per_sequence == KDA_LAYERS * kda_state_bytes(tp)
    assert kv.block_size == block_size
    assert kv.page_bytes == block_size * (KV_LORA_RANK + ROPE) * BF16
    assert kv.page_bytes >= kda_state_bytes(tp) > kv.page_bytes - 128 * 576 * BF16


def test_fp8_kv_cache_halves_the_mla_bytes(kimi_model):
    from vllm_kimi_k3_moe.tools.deployment.topology import Serving

    result = plan_deployment(
        KIMI_K3_TEXT_CONFIG, Deployment(32), Serving(kv_cache_dtype="fp8")
    )
    assert result.kv_cache.mla_bytes_per_token == MLA_LAYERS * 576  # one byte
    assert result.kv_cache.kda_bytes_per_sequence == KDA_LAYERS * kda_state_bytes(32)


def test_kv_tokens_follow_the_memory_left(kimi_k3_deployment_plans):
    """At TP32 on H20s, what vLLM leaves next to the fixed model (its share
    less the weights and the reserve: ``test_kv_budget``) becomes KV
    cache: about that many bytes over the bytes a token costs, less what
    each request's KDA state holds; upstream nothing is left."""
    result = kimi_k3_deployment_plans[32]
    budget, fixed = result.budget, result.fixed_kv
    left = budget.kv_cache_bytes(result.fixed.total_bytes)
    assert fixed.available_bytes == left > 0
    # a request: 131072 tokens of MLA cache + 3 KDA groups x 3 blocks of state
    blocks = left // (MLA_LAYERS * result.kv_cache.page_bytes)
    per_request = 131072 // 256 + 3 * 3
    assert fixed.concurrency == pytest.approx((blocks - 1) / per_request, rel=1e-3)
    assert fixed.tokens == int(fixed.concurrency * 131072)
    assert result.upstream_kv.tokens == 0
    assert result.upstream_kv.available_bytes < 0
    assert budget.kv_cache_bytes(result.upstream.total_bytes) < 0


@pytest.mark.parametrize("dcp", [2, 8, 32])
def test_dcp_splits_each_requests_mla_tokens_not_its_kda_state(
    kimi_k3_h20_planner, dcp
):
    """TP32 on H20s with DCP: the same weights and memory left (DCP changes
    no parameter), but a request takes a GPU's MLA blocks for 1/dcp of its
    131072 tokens and still every KDA state block (3 groups x 3 blocks:
    the state is replicated over the DCP group)."""
    without = kimi_k3_h20_planner.plan(Deployment(32))
    result = kimi_k3_h20_planner.plan(Deployment(32, dcp_size=dcp))
    assert result.fixed.components == without.fixed.components
    left = result.fixed_kv.available_bytes
    assert left == without.fixed_kv.available_bytes
    blocks = left // (MLA_LAYERS * result.kv_cache.page_bytes)
    per_request = math.ceil(131072 / dcp / 256) + 3 * 3
    assert result.fixed_kv.concurrency == pytest.approx(
        (blocks - 1) / per_request, rel=1e-3
    )
    assert result.fixed_kv.tokens == int(result.fixed_kv.concurrency * 131072)
    assert result.kv_cache.dcp_size == dcp


@pytest.mark.parametrize(
    ("gib", "upstream_fits", "fixed_fits"),
    [(80, False, False), (96, False, True), (141, False, True), (192, True, True)],
)
def test_tp32_fit_by_gpu_size(kimi_k3_plan, gib, upstream_fits, fixed_fits):
    result = kimi_k3_plan(Deployment(32), GpuBudget(gib))
    assert (result.upstream_kv.tokens > 0) == upstream_fits
    assert (result.fixed_kv.tokens > 0) == fixed_fits
    assert result.fixed_kv.tokens >= result.upstream_kv.tokens


def test_default_utilization_is_vllms(kimi_k3_deployment_plans):
    """Unset, plan sizes with vLLM's own default as vLLM resolves it for
    the sizing it does on the serving GPUs: ``CacheConfig``'s field (vLLM
    0.33: 0.92), or on vLLM 0.34, whose field is unset, its resolution with
    the extensible KV cache (``test_kv_budget``: on, as on CUDA)."""
    from vllm.config import CacheConfig

    budget = kimi_k3_deployment_plans[32].budget
    default = CacheConfig()
    if budget.after_warmup:
        assert default.gpu_memory_utilization is None
        default.enable_extensible_kv_cache = True
    assert budget.utilization == compat.resolved_gpu_memory_utilization(default)
    assert not budget.utilization_given


@pytest.mark.parametrize("bad", [0, -0.1, 1.01])
def test_utilization_outside_zero_one_is_refused(bad):
    from vllm_kimi_k3_moe.tools.deployment.gpu_budget import BudgetError

    with pytest.raises(BudgetError, match=r"\(0, 1\]"):
        GpuBudget(80, utilization=bad)


@pytest.fixture(scope="module")
def formats(kimi_k3_plan) -> dict[tuple[str, int], object]:
    return {
        (fmt, tp): kimi_k3_plan(Deployment(tp, quantization=fmt))
        for fmt in FORMAT_NAMES
        for tp in (8, 16, 32)
    }


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_every_format_builds_whole_and_never_larger(formats, fmt):
    for tp in (8, 16, 32):
        result = formats[fmt, tp]
        assert result.fixed.total_bytes <= result.upstream.total_bytes
        # only the routed experts differ between upstream and fixed
        for name, size in result.fixed.components.items():
            if name != "moe_routed_experts":
                assert size == result.upstream.components[name], (fmt, tp, name)
    assert formats[fmt, 8].fixed == formats[fmt, 8].upstream  # nothing padded
    assert formats[fmt, 32].fixed.total_bytes < formats[fmt, 32].upstream.total_bytes


def test_every_format_gets_its_vllm_method(kimi_model):
    """vLLM resolves each format's published config to a routed-expert
    method of that format's record (and none of another's)."""
    import tempfile
    from pathlib import Path

    from vllm_kimi_k3_moe.formats import FORMATS, format_of_method
    from vllm_kimi_k3_moe.tools.deployment.topology import Serving
    from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
        write_model_dir,
    )
    from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank
    from vllm_kimi_k3_moe.tools.plan.planner import kimi_moe_classes

    _, fixed_cls = kimi_moe_classes()
    for fmt in FORMATS:
        deployment = Deployment(32, quantization=fmt.name)
        with tempfile.TemporaryDirectory() as directory:
            model_dir = write_model_dir(
                KIMI_K3_TEXT_CONFIG,
                fmt.published_quantization_config(),
                Serving(),
                Path(directory),
            )
            model = build_rank(
                fixed_cls, KIMI_K3_TEXT_CONFIG, deployment, Serving(), model_dir
            ).model
        method = model.language_model.model.layers[
            1
        ].block_sparse_moe.experts.routed_experts
        assert type(method.quant_method).__name__ in fmt.vllm_methods, fmt.name
        assert format_of_method(method.quant_method) is fmt


def test_formats_order_by_bytes_per_expert_value_at_tp32(formats):
    """BF16 2 bytes per expert value, FP8 1 (+ block scales), the 4-bit
    formats about half. Each 4-bit format is allocated the rows its kernel
    keeps once it prepared them: Marlin's 128 for MXFP4 and INT4 in groups
    of 32 (96 would be padded again there), NVFP4's 96 padded to 128 too."""
    sizes = {fmt: formats[fmt, 32].fixed.total_bytes for fmt in FORMAT_NAMES}
    assert sizes["bf16"] > sizes["fp8-block"] > sizes["w4a16"] > sizes["mxfp4"]
    assert sizes["nvfp4"] == sizes["modelopt-nvfp4"]
    for fmt in ("mxfp4", "w4a16", "nvfp4", "modelopt-nvfp4"):
        assert formats[fmt, 32].moe.fixed.intermediate_per_rank == 128, fmt


@pytest.mark.parametrize(
    "deployment",
    [
        Deployment(16),
        Deployment(8, dp_size=4),
        Deployment(32, expert_parallel=True),
        Deployment(8, dp_size=4, expert_parallel=True),
    ],
    ids=["TP16", "TP8 DP4", "TP32 EP", "TP8 DP4 EP"],
)
def test_other_topologies_build_whole(kimi_k3_plan, deployment):
    result = kimi_k3_plan(deployment, GpuBudget(141))
    assert result.fixed.total_bytes <= result.upstream.total_bytes
    experts = KIMI_K3_TEXT_CONFIG["num_experts"]
    assert result.moe.fixed.local_experts == deployment.experts_per_gpu(experts)
    assert result.fixed_kv.tokens >= result.upstream_kv.tokens


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if f != "mxfp4"])
def test_every_offered_backend_builds_the_format(kimi_k3_plan, fmt):
    for backend in format_named(fmt).moe_backends:
        result = kimi_k3_plan(Deployment(32, backend=backend, quantization=fmt))
        assert result.moe.fixed.intermediate_per_rank <= 256, (fmt, backend)


def test_a_layout_only_the_plugin_builds_is_sized_and_says_so(kimi_k3_plan):
    """FP8 blocks at TP8 x DP4: every expert over 32 GPUs with no model-level
    padding, 96 rows each, which vLLM alone's FP8 block method refuses; the
    plugin gives the first 24 GPUs whole 128-row blocks. plan sizes it, and
    vLLM alone's side says it cannot build it (vLLM's own error)."""
    from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
    from vllm_kimi_k3_moe.tools.plan.report import table

    result = kimi_k3_plan(
        Deployment(8, dp_size=4, quantization="fp8-block"),
        GpuBudget(gpu_preset("b200").memory_gib),
    )
    assert result.moe.fixed.intermediate_per_rank == 128
    assert result.moe.upstream is None and result.upstream is None
    assert "not divisible by weight quantization block_n = 128" in (
        result.moe.upstream_refusal or ""
    )
    assert result.fits("upstream") is False and result.fits("fixed") is True
    document = result.to_dict()
    assert document["whole_model"]["upstream_bytes"] is None
    assert document["kv_cache"]["upstream_tokens"] == 0
    row = table([result]).splitlines()[4]
    assert row.split()[:5] == ["TP8", "DP4", "32", "4", "-"]  # GPUs, nodes
    assert row.endswith(f"{compat.VLLM} alone cannot build it")
