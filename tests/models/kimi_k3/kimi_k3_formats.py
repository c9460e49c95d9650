"""The checkpoint formats Kimi-K3 is published in, as vLLM 0.33.0 configures them,
and the wider space of configs vLLM accepts for its experts
(``quantization_space``), each under its name.

Each format is the ``quantization_config`` block of a published checkpoint,
turned into vLLM's quantization config by vLLM itself, restricted to the
routed experts where vLLM has no CPU kernel for the format's linear layers
(the MoE method is chosen from the expert scheme alone).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

from tests.models.kimi_k3.quantization_space import (
    SPACE,
    awq,
    compressed_tensors,
    gptq,
)
from vllm_kimi_k3_moe.formats import FORMAT_NAMES, mxfp4
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    rank_vllm_config,
    write_model_dir,
)

FP8 = {"num_bits": 8, "type": "float", "symmetric": True}


# INT4: as MXFP4's weights, but integers.
INT4_GROUP_32 = {**mxfp4.WEIGHTS, "type": "int"}


NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}

QUANTIZATION_CONFIGS: dict[str, dict[str, Any] | None] = {
    # Native MXFP4: what vLLM rewrites the released mxfp4-pack-quantized to.
    "mxfp4": {"quant_method": "mxfp4"},
    # Other compressed-tensors MXFP4 (FP4, groups of 32, E8M0 scales): a
    # format vLLM does not rewrite to native MXFP4.
    "ct-mxfp4": compressed_tensors(mxfp4.WEIGHTS, None, "pack-quantized"),
    # FP8 block [128, 128], activations dynamic per group of 128 (TP16 and up).
    "fp8-block": compressed_tensors(
        {**FP8, "dynamic": False, "strategy": "block", "block_structure": [128, 128]},
        {**FP8, "dynamic": True, "strategy": "group", "group_size": 128},
        "float-quantized",
    ),
    "nvfp4": compressed_tensors(
        {**NVFP4, "symmetric": True, "dynamic": False},
        {**NVFP4, "symmetric": True, "dynamic": "local"},
        "nvfp4-pack-quantized",
    ),
    # ModelOpt NVFP4: NVFP4 experts; everything else left to BF16 here.
    "modelopt-nvfp4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": [
            "*shared_experts*",
            "*routed_expert_down_proj*",
            "*routed_expert_up_proj*",
            "*gate*",
        ],
    },
    # INT4 W4A16 conversions: int4, groups of 32, symmetric.
    "w4a16": compressed_tensors(INT4_GROUP_32, None, "pack-quantized"),
    # AutoAWQ and AutoGPTQ INT4 in groups of 128 (AWQ with zero points)
    "awq": awq(128),
    "gptq": gptq(4, 128, True),
    # BF16 dequantizations: no quantization config at all.
    "bf16": None,
}

# The published formats with a config above (AWQ and GPTQ are in SPACE).
PUBLISHED_FORMATS = tuple(f for f in QUANTIZATION_CONFIGS if f in FORMAT_NAMES)
QUANTIZATION_CONFIGS |= SPACE
# A config no format of the registry names: FP8 per output channel (vLLM's
# compressed-tensors FP8 method with a strategy no format describes), whose
# partition rule the plugin learns from the method itself.
LEARNED_FORMAT = "ct-fp8-channel"


# One directory for every format's config.json, removed when the process
# exits (TemporaryDirectory's finalizer), so that no session leaves any behind.
_MODEL_DIRS = tempfile.TemporaryDirectory(prefix="kimi-k3-formats-")


@functools.cache
def format_model_dir(fmt: str) -> Path:
    """A weightless model directory: Kimi-K3's published text config with
    ``fmt``'s experts-only quantization config (written once a session)."""
    directory = Path(_MODEL_DIRS.name) / fmt
    directory.mkdir()
    return write_model_dir(
        KIMI_K3_TEXT_CONFIG, QUANTIZATION_CONFIGS[fmt], Serving(), directory
    )


@functools.cache
def release_model_dir() -> Path:
    """A weightless model directory of the release as published: Kimi-K3's
    text config and MXFP4's published quantization config (written once a
    session)."""
    directory = Path(_MODEL_DIRS.name) / "release"
    directory.mkdir()
    return write_model_dir(
        KIMI_K3_TEXT_CONFIG,
        mxfp4.RELEASE.published_quantization_config(),
        Serving(),
        directory,
    )


def format_vllm_config(rank: Rank | Topology, fmt: str, moe_backend: str) -> Any:
    """A fresh ``VllmConfig`` for one rank of a topology serving Kimi-K3's
    routed experts in ``fmt`` with ``--moe-backend moe_backend``, as vLLM
    resolves the format's config (the tools' one builder)."""
    topology = rank.topology if isinstance(rank, Rank) else rank
    return rank_vllm_config(format_model_dir(fmt), topology, moe_backend)
