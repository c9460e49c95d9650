"""Quantization configs for Kimi-K3's routed experts drawn from the space vLLM
0.33.0 accepts, not from the published presets: every parameter vLLM reads
for the experts' method, crossed.

- compressed-tensors integer weights (``CompressedTensorsWNA16MoEMethod``):
  4 and 8 bits, groups of 32, 64 and 128, symmetric, and 4 bits asymmetric
  (no kernel vLLM has takes 8-bit zero points with Kimi-K3's SiTU);
- AutoAWQ (``AutoAWQConfig``: 4 bits, zero points) in groups of 32, 64, 128;
- AutoGPTQ (``AutoGPTQConfig``: symmetric only, ``desc_act`` off): 4 and 8
  bits, groups of 64 and 128;
- compressed-tensors FP8 in blocks of [128, 128], per output channel, per
  tensor; vLLM's native FP8 (``quant_method: fp8``) in blocks of [128, 128]
  and per tensor; ModelOpt FP8, FP8_PB_WO and MXFP8; compressed-tensors
  MXFP8; compressed-tensors INT4 per channel;
- NVFP4 (compressed-tensors, ModelOpt), MXFP4 (native, compressed-tensors),
  BF16: the published formats, each one point of its space.

Every config quantizes the routed experts alone: vLLM has no CPU kernel for
the other formats' linear layers, and the experts' method is chosen from
their scheme alone.
"""

from __future__ import annotations

from itertools import product
from typing import Any

EXPERTS_ONLY = [r"re:.*\.experts\.\d+\..+"]
# Every module of a KimiMoE but its routed experts, as AutoAWQ's substring
# match and AutoGPTQ's negative ("-:") regex name them.
NOT_EXPERTS = [
    "shared_experts",
    "routed_expert_down_proj",
    "routed_expert_up_proj",
    "block_sparse_moe.gate",
]
GPTQ_SKIP = {r"-:.*(shared_experts|routed_expert_(up|down)_proj|moe\.gate).*": {}}

INT_BITS = (4, 8)
INT_GROUPS = (32, 64, 128)
SYMMETRY = (True, False)


def compressed_tensors(weights: dict, inputs: dict | None, fmt: str) -> dict[str, Any]:
    """A compressed-tensors config whose one group targets the experts."""
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


def compressed_tensors_int(bits: int, group: int, symmetric: bool) -> dict[str, Any]:
    weights = {
        "num_bits": bits,
        "type": "int",
        "strategy": "group",
        "group_size": group,
        "symmetric": symmetric,
        "dynamic": False,
    }
    return compressed_tensors(weights, None, "pack-quantized")


def awq(group: int) -> dict[str, Any]:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": NOT_EXPERTS,
    }


def gptq(bits: int, group: int, symmetric: bool) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": False,
        "sym": symmetric,
        "dynamic": GPTQ_SKIP,
    }


FP8 = {"num_bits": 8, "type": "float", "symmetric": True}


def fp8(strategy: str) -> dict[str, Any]:
    weights = {**FP8, "dynamic": False, "strategy": strategy}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
        inputs = {**FP8, "dynamic": True, "strategy": "group", "group_size": 128}
    else:  # per tensor with per-tensor inputs, per channel with per token
        inputs = {**FP8, "dynamic": True}
        inputs["strategy"] = "tensor" if strategy == "tensor" else "token"
    return compressed_tensors(weights, inputs, "float-quantized")


def _symmetry(symmetric: bool) -> str:
    return "sym" if symmetric else "asym"


# Every module of a KimiMoE but its routed experts, as vLLM's native FP8
# config matches ignored layers (exactly, at the suite's layer prefix) and
# as ModelOpt's does (fnmatch patterns).
MOE_PREFIX = "model.layers.1.block_sparse_moe"
FP8_IGNORED = [
    f"{MOE_PREFIX}.{module}"
    for module in (
        "shared_experts.gate_up_proj",
        "shared_experts.down_proj",
        "routed_expert_up_proj",
        "routed_expert_down_proj",
        "gate",
    )
]
MODELOPT_IGNORED = [f"*{module}*" for module in NOT_EXPERTS]


def native_fp8(block: list[int] | None) -> dict[str, Any]:
    """vLLM's own FP8 (DeepSeek-V3 and Kimi-K2 ship it: ``quant_method:
    fp8``), in blocks or per tensor."""
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "ignored_layers": FP8_IGNORED,
    }
    if block is not None:
        config["weight_block_size"] = block
    return config


def modelopt(algo: str) -> dict[str, Any]:
    return {"quant_method": "modelopt", "quant_algo": algo, "ignore": MODELOPT_IGNORED}


MXFP8 = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}


SPACE: dict[str, dict[str, Any]] = {
    **{
        f"ct-int{bits}-g{group}-{_symmetry(sym)}": compressed_tensors_int(
            bits, group, sym
        )
        for bits, group, sym in product(INT_BITS, INT_GROUPS, SYMMETRY)
        if sym or bits == 4
    },
    **{f"awq-int4-g{group}": awq(group) for group in INT_GROUPS},
    **{
        f"gptq-int{bits}-g{group}": gptq(bits, group, True)
        for bits, group in product(INT_BITS, (64, 128))
    },
    **{f"ct-fp8-{strategy}": fp8(strategy) for strategy in ("channel", "tensor")},
    # configs no format of the plugin's registry names: their rule is learned
    "fp8-native-block": native_fp8([128, 128]),
    "fp8-native-tensor": native_fp8(None),
    **{
        f"modelopt-{algo.lower().replace('_', '-')}": modelopt(algo)
        for algo in ("FP8", "FP8_PB_WO")
    },
    "modelopt-mxfp8": modelopt("MXFP8"),
    "ct-mxfp8": compressed_tensors(
        {**MXFP8, "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
        {**MXFP8, "symmetric": True, "dynamic": True, "scale_dtype": "torch.uint8"},
        "mxfp8-quantized",
    ),
    "ct-int4-channel": compressed_tensors(
        {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": True},
        None,
        "pack-quantized",
    ),
}
