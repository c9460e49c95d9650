"""The checkpoint formats Kimi-K3 is published in, as vLLM 0.33.0 configures them.

Each format is the ``quantization_config`` block of a published checkpoint,
turned into vLLM's quantization config by vLLM itself, restricted to the
routed experts where vLLM has no CPU kernel for the format's linear layers
(the MoE method is chosen from the expert scheme alone).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.tools.build.rank import (
    COMPRESSED_TENSORS_MXFP4_EXPERTS,
    MXFP4_WEIGHT_ARGS,
)

EXPERTS_ONLY = [r"re:.*\.experts\.\d+\..+"]


def _compressed_tensors(weights: dict, inputs: dict | None, fmt: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": [],
        "config_groups": {
            "routed_experts": {
                "targets": EXPERTS_ONLY,
                "weights": weights,
                "input_activations": inputs,
                "format": fmt,
            }
        },
    }


FP8 = {"num_bits": 8, "type": "float", "symmetric": True}


# INT4: as MXFP4's weights, but integers.
INT4_GROUP_32 = {**MXFP4_WEIGHT_ARGS, "type": "int"}


NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}

QUANTIZATION_CONFIGS: dict[str, dict[str, Any] | None] = {
    # Native MXFP4: what vLLM rewrites the released mxfp4-pack-quantized to.
    "mxfp4": {"quant_method": "mxfp4"},
    # Other compressed-tensors MXFP4 (FP4, groups of 32, E8M0 scales).
    "ct-mxfp4": COMPRESSED_TENSORS_MXFP4_EXPERTS,
    # FP8 block [128, 128], activations dynamic per group of 128 (TP16 and up).
    "ct-fp8-block": _compressed_tensors(
        {**FP8, "dynamic": False, "strategy": "block", "block_structure": [128, 128]},
        {**FP8, "dynamic": True, "strategy": "group", "group_size": 128},
        "float-quantized",
    ),
    "ct-nvfp4": _compressed_tensors(
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
    "ct-w4a16": _compressed_tensors(INT4_GROUP_32, None, "pack-quantized"),
    # BF16 dequantizations: no quantization config at all.
    "bf16": None,
}

# A format no rule of the plugin covers: FP8 per output channel (vLLM's FP8
# method with a strategy that puts no constraint the plugin knows of).
UNCOVERED_FORMAT = "ct-fp8-channel"
QUANTIZATION_CONFIGS[UNCOVERED_FORMAT] = _compressed_tensors(
    {**FP8, "dynamic": False, "strategy": "channel"},
    {**FP8, "dynamic": True, "strategy": "token"},
    "float-quantized",
)
PUBLISHED_FORMATS = tuple(f for f in QUANTIZATION_CONFIGS if f != UNCOVERED_FORMAT)


@dataclass(frozen=True)
class Format:
    name: str

    def quant_config(self) -> Any:
        """vLLM's quantization config for this format, built by vLLM."""
        document = copy.deepcopy(QUANTIZATION_CONFIGS[self.name])
        if document is None:
            return None
        from vllm.model_executor.layers.quantization import (
            QUANTIZATION_METHODS,
            get_quantization_config,
        )

        # As ModelConfig._verify_quantization: a method may claim a config
        # (ModelOpt's "modelopt" with quant_algo NVFP4 is "modelopt_fp4").
        method = document["quant_method"]
        for candidate in QUANTIZATION_METHODS:
            claim = get_quantization_config(candidate).override_quantization_method(
                document, None
            )
            if claim is not None:
                method = claim
                break
        return get_quantization_config(method).from_config(document)


def format_vllm_config(topology: Any, fmt: str, moe_backend: str) -> Any:
    """A fresh ``VllmConfig`` for one rank of ``topology`` serving Kimi-K3
    in ``fmt`` with ``--moe-backend moe_backend``."""
    from vllm.config import DeviceConfig, VllmConfig

    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        quant_config=Format(fmt).quant_config(),
    )
    vllm_config.kernel_config.moe_backend = moe_backend
    parallel = vllm_config.parallel_config
    parallel.tensor_parallel_size = topology.tp_size
    parallel.data_parallel_size = topology.dp_size
    parallel.enable_expert_parallel = topology.expert_parallel
    return vllm_config
