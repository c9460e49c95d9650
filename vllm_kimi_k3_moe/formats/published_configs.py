"""The quantization configs of the formats Kimi-K3 is published in, for ``plan``.

Each is the ``quantization_config`` block a checkpoint of that format carries
in its ``config.json``; ``plan`` writes it into a weightless ``config.json``
and vLLM 0.33.0 resolves it as it resolves a checkpoint's (the method per
layer, the ignore list). What each quantizes:

- ``mxfp4`` (the release, compressed-tensors ``mxfp4-pack-quantized``,
  rewritten by vLLM's ``KimiK3ForConditionalGenerationConfig`` to native
  MXFP4) and ``w4a16`` (INT4 conversions in the style of Kimi-K2-Thinking):
  the routed experts only; attention, the dense MLP, shared experts, the
  latent projections, router and ``lm_head`` stay BF16.
- ``compressed-tensors`` (other compressed-tensors MXFP4): the routed
  experts, as the MoE-layer planner has always sized it.
- ``fp8-block`` (compressed-tensors FP8, [128, 128] weight blocks): every
  linear layer vLLM can shard in whole 128-blocks at TP8, TP16 and TP32; the
  KDA input projections, MLA's fused q_a/kv_a/g and q_b projections, the
  dense MLP and the shared experts cannot be (vLLM refuses a per-rank slice
  of 3-12 KDA heads, 576 MLA rows, 1056 or 2112 dense rows, 192 shared rows
  with "not divisible by weight quantization block_n = 128"), so a checkpoint
  that vLLM serves at those sizes leaves them BF16, as do the router and
  ``lm_head``.
- ``nvfp4`` (compressed-tensors) and ``modelopt-nvfp4`` (NVIDIA ModelOpt):
  every MLP (routed and shared experts, the dense MLP, the latent
  projections) in NVFP4; attention, router and ``lm_head`` BF16.
- ``bf16``: no quantization config.

Not every public copy of a format lists the same layers; where a checkpoint
quantizes more or less than this, its non-expert figures differ (the
routed experts, nearly all of the weights, do not).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from vllm_kimi_k3_moe.tools.build.rank import MXFP4_WEIGHT_ARGS

MXFP4_WEIGHTS = MXFP4_WEIGHT_ARGS
FP8_BLOCK_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "block",
    "block_structure": [128, 128],
    "symmetric": True,
    "dynamic": False,
}
FP8_GROUP_INPUTS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "group",
    "group_size": 128,
    "symmetric": True,
    "dynamic": True,
}
NVFP4_WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
}
NVFP4_INPUTS = {**NVFP4_WEIGHTS, "dynamic": "local"}
INT4_WEIGHTS = {**MXFP4_WEIGHTS, "type": "int"}

# Names as both the checkpoint and vLLM's modules spell them.
ROUTER = r"re:.*block_sparse_moe\.gate$"
ATTENTION = r"re:.*self_attn\..*"
# Built unquantized by vLLM whatever the config says; listed as checkpoints do.
ATTENTION_RESIDUALS = r"re:.*_res_proj"
EVERYTHING_BUT_ROUTED_EXPERTS = [
    "lm_head",
    ATTENTION,
    r"re:.*\.mlp\..*",
    r"re:.*block_sparse_moe\.shared_experts\..*",
    r"re:.*block_sparse_moe\.routed_expert_(up|down)_proj",
    ROUTER,
    ATTENTION_RESIDUALS,
]
FP8_BLOCK_UNSHARDABLE = [
    "lm_head",
    ROUTER,
    ATTENTION_RESIDUALS,
    r"re:.*self_attn\.(q|k|v|g|b|f_a)_proj",  # KDA's fused input projection
    r"re:.*self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj)",  # MLA
    r"re:.*\.mlp\..*",
    r"re:.*block_sparse_moe\.shared_experts\..*",
]


def _compressed_tensors(
    fmt: str, weights: dict, inputs: dict | None, ignore: list[str]
) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


PUBLISHED_QUANTIZATION_CONFIGS: dict[str, dict[str, Any] | None] = {
    "mxfp4": _compressed_tensors(
        "mxfp4-pack-quantized", MXFP4_WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    "compressed-tensors": _compressed_tensors(
        "pack-quantized", MXFP4_WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    "fp8-block": _compressed_tensors(
        "float-quantized", FP8_BLOCK_WEIGHTS, FP8_GROUP_INPUTS, FP8_BLOCK_UNSHARDABLE
    ),
    "nvfp4": _compressed_tensors(
        "nvfp4-pack-quantized",
        NVFP4_WEIGHTS,
        NVFP4_INPUTS,
        ["lm_head", ATTENTION, ROUTER, ATTENTION_RESIDUALS],
    ),
    "modelopt-nvfp4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_scheme": None,
        "producer": {"name": "modelopt"},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": NVFP4_WEIGHTS,
                "input_activations": NVFP4_INPUTS,
            }
        },
        "ignore": ["lm_head", "*self_attn*", "*block_sparse_moe.gate", "*_res_proj"],
    },
    "w4a16": _compressed_tensors(
        "pack-quantized", INT4_WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    "bf16": None,
}


def quantization_config(name: str) -> dict[str, Any] | None:
    """The ``quantization_config`` a Kimi-K3 checkpoint in format ``name``
    hands vLLM, after vLLM's own Kimi-K3 hook (which turns the release's
    compressed-tensors MXFP4 into native MXFP4; it runs for the multimodal
    architecture, not for the language model ``plan`` builds)."""
    document = copy.deepcopy(PUBLISHED_QUANTIZATION_CONFIGS[name])
    if name == "mxfp4":
        from vllm.model_executor.models.config import (
            KimiK3ForConditionalGenerationConfig,
        )

        holder = SimpleNamespace(quantization_config=document)
        KimiK3ForConditionalGenerationConfig.verify_and_update_model_config(
            SimpleNamespace(
                hf_config=holder, hf_text_config=holder, model_arch_config=holder
            )
        )
    return document
