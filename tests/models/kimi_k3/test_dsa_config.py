"""A config with ``dsa_config`` (Kimi-K3.1's DSA layers) is sized as the
installed vLLM builds it: vLLM 0.34 builds those MLA layers as DSA layers,
each with its indexer (weights, and keys cached per token beside its MLA
cache) and one top-k buffer for all of them; vLLM 0.33 reads no
``dsa_config`` (every figure is the dense model's), and plan says so in one
line."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from vllm_kimi_k3_moe import compat
from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    rank_vllm_config,
    write_model_dir,
)
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank
from vllm_kimi_k3_moe.tools.plan.planner import plan_deployment

# Kimi-K3 cut to 8 layers: MLA at 1-based 4 and 8, KDA elsewhere, the first
# one dense; both MLA layers DSA (as Kimi-K3.1 puts DSA on every one)
LAYERS = 8
MLA = [4, 8]
HIDDEN, Q_LORA_RANK, KV_LORA_RANK, ROPE = 7168, 1536, 512, 64
INDEX_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 16, 64, 512
BF16, FP32, INT32 = 2, 4, 4
SMALL = {
    **KIMI_K3_TEXT_CONFIG,
    "num_hidden_layers": LAYERS,
    "linear_attn_config": {
        **KIMI_K3_TEXT_CONFIG["linear_attn_config"],
        "full_attn_layers": MLA,
        "kda_layers": [n for n in range(1, LAYERS + 1) if n not in MLA],
    },
}
WITH_DSA = {
    **SMALL,
    "dsa_config": {
        "dsa_layers": MLA,
        "index_topk": INDEX_TOPK,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_num_heads": INDEX_HEADS,
        "index_k_norm_type": "layernorm",
    },
}
# One DSA layer's indexer, beside the MLA projections a dense layer has:
# wq_index from the query LoRA to every index head, wkv_index from the
# hidden state to the shared key and a weight per head (bf16, replicated on
# every GPU), and the key's LayerNorm (weight and bias, fp32)
INDEXER_BYTES = (
    Q_LORA_RANK * INDEX_HEADS * INDEX_HEAD_DIM + HIDDEN * (INDEX_HEAD_DIM + INDEX_HEADS)
) * BF16 + 2 * INDEX_HEAD_DIM * FP32
INDEXER_KEY_BYTES = INDEX_HEAD_DIM + FP32  # FP8 key and its fp32 scale per token
MLA_TOKEN_BYTES = (KV_LORA_RANK + ROPE) * BF16
DEPLOYMENT = Deployment(8)
H200 = GpuBudget(141)


def dsa_built() -> int:
    """DSA layers the installed vLLM builds of ``WITH_DSA``."""
    return len(MLA) if compat.builds_dsa_layers() else 0


@pytest.fixture(scope="module")
def plans(kimi_model) -> dict[str, object]:
    return {
        name: plan_deployment(config, DEPLOYMENT, budget=H200)
        for name, config in (("dense", SMALL), ("dsa", WITH_DSA))
    }


@pytest.fixture(scope="module")
def model_dir(kimi_model):
    with tempfile.TemporaryDirectory() as directory:
        yield write_model_dir(
            WITH_DSA,
            mxfp4.RELEASE.published_quantization_config(),
            Serving(),
            Path(directory),
        )


def test_the_dsa_layers_are_vllms_own(kimi_model, model_dir):
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    built = build_rank(kimi_model.KimiMoE, WITH_DSA, DEPLOYMENT, Serving(), model_dir)
    layers = built.model.language_model.model.layers
    attention = [type(layer.self_attn).__name__ for layer in layers]
    assert attention.count("KimiK3DSAAttention") == dsa_built()
    if compat.builds_dsa_layers():
        config = KimiLinearConfig(**WITH_DSA)
        assert [config.is_dsa_layer(i) for i in range(LAYERS)] == [
            name == "KimiK3DSAAttention" for name in attention
        ]


def test_each_dsa_layer_adds_its_indexer_and_one_buffer_for_all(plans, model_dir):
    """Every other weight is the dense model's; the top-k buffer holds
    ``index_topk`` int32 indices for every token of a step
    (``max_num_batched_tokens`` of the rank's scheduler config)."""
    dense, dsa = plans["dense"].fixed.components, plans["dsa"].fixed.components
    assert dsa["mla_attention"] - dense["mla_attention"] == (
        dsa_built() * INDEXER_BYTES
    )
    scheduler = rank_vllm_config(model_dir, Topology(8), "marlin").scheduler_config
    buffer = scheduler.max_num_batched_tokens * INDEX_TOPK * INT32
    assert dsa["dsa_topk_indices"] == (buffer if dsa_built() else 0)
    others = set(dense) - {"mla_attention", "dsa_topk_indices"}
    assert {name: dsa[name] for name in others} == {
        name: dense[name] for name in others
    }


def test_the_indexer_keys_take_kv_cache(plans):
    """vLLM's planner sizes the indexer caches with the MLA caches: the
    tokens it gives, at their bytes per token, fit the memory left."""
    shape, kv = plans["dsa"].kv_cache, plans["dsa"].fixed_kv
    assert shape.mla_layers == len(MLA)
    assert shape.mla_bytes_per_token == len(MLA) * MLA_TOKEN_BYTES
    assert shape.dsa_layers == dsa_built()
    assert shape.indexer_bytes_per_token == dsa_built() * INDEXER_KEY_BYTES
    per_token = shape.mla_bytes_per_token + shape.indexer_bytes_per_token
    assert 0 < kv.tokens * per_token <= kv.available_bytes
    if not dsa_built():  # every figure is the dense model's
        assert plans["dsa"].fixed_kv == plans["dense"].fixed_kv


def test_plan_says_when_this_vllm_builds_no_dsa_layers(kimi_model, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": WITH_DSA}))
    assert main(["plan", "--config", str(path), "--tp", "8", "--gpu", "h200"]) == 0
    out, err = capsys.readouterr()
    noted = [line for line in err.splitlines() if "DSA" in line]
    if compat.builds_dsa_layers():
        assert noted == []
        assert "are DSA layers" in out
    else:
        (line,) = noted
        assert f"{compat.VLLM} does not build DSA layers" in line
        assert "DSA" not in out
