"""AutoAWQ and AutoGPTQ: integer weights packed into int32, stored
input-first (``qweight``, ``qzeros``, ``scales``).

vLLM 0.33.0 serves an ``awq`` checkpoint with ``AutoAWQConfig`` (4 bits,
zero points) and a ``gptq`` one with ``AutoGPTQConfig`` (4 or 8 bits,
symmetric or not): their experts get ``AutoAWQMoEMethod`` and
``AutoGPTQMoEMethod`` on Marlin where ``check_moe_marlin_supports_layer``
takes the layer, and otherwise fall back to ``MoeWNA16Method`` (another
kernel, for which the plugin has no rule: it keeps vLLM alone's partition).
Their rule is the integer formats' (``int_groups.RULE``).
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.formats import int_groups
from vllm_kimi_k3_moe.formats.layouts import (
    FLOAT_SCALES,
    ExpertTensorLayout,
    ExpertTensors,
)
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    KimiK3Format,
    QuantizationScheme,
)

GROUP = 128  # the usual AWQ and GPTQ group
MOE_BACKENDS = ("marlin",)  # the Marlin methods; their fallback is not theirs
# Substrings (AWQ) of every module but the routed experts: they stay BF16.
NOT_CONVERTED = [
    "vision_tower",
    "mm_projector",
    "lm_head",
    "self_attn",
    ".mlp.",
    "shared_experts",
    "routed_expert_down_proj",
    "routed_expert_up_proj",
    "block_sparse_moe.gate",
    "_res_proj",
]


def tensors(
    label: str, num_bits: int, group_size: int, packed_input: bool
) -> ExpertTensors:
    """``qweight`` packed along the input (GPTQ) or the output (AWQ),
    ``qzeros`` packed along the output, ``scales`` one per group; all
    ``[input, output]``."""
    pack = 32 // num_bits
    qweight = (
        ExpertTensorLayout("qweight", pack, dtypes=("I32",), transposed=True)
        if packed_input
        else ExpertTensorLayout("qweight", 1, pack, ("I32",), transposed=True)
    )
    return ExpertTensors(
        label,
        (
            qweight,
            ExpertTensorLayout("qzeros", group_size, pack, ("I32",), transposed=True),
            ExpertTensorLayout("scales", group_size, 1, FLOAT_SCALES, transposed=True),
        ),
    )


def _parameters(scheme: QuantizationScheme) -> tuple[Any, Any]:
    config = scheme.config or {}
    bits = config.get("bits", config.get("w_bit"))
    group = config.get("group_size", config.get("q_group_size"))
    return bits, group


def _recognises_awq(scheme: QuantizationScheme) -> CheckpointFormat | None:
    bits, group = _parameters(scheme)
    if scheme.quant_method != "awq" or bits != 4 or not isinstance(group, int):
        return None
    awq_tensors = tensors("AWQ INT4", 4, group, packed_input=False)
    return int_groups.checkpoint_format(
        AWQ, f"AutoAWQ INT4, groups of {group}", awq_tensors, bits, group
    )


def _recognises_gptq(scheme: QuantizationScheme) -> CheckpointFormat | None:
    bits, group = _parameters(scheme)
    if (
        scheme.quant_method != "gptq"
        or bits not in (4, 8)
        or not isinstance(group, int)
    ):
        return None
    symmetric = "symmetric" if (scheme.config or {}).get("sym", True) else "asymmetric"
    gptq_tensors = tensors(f"GPTQ INT{bits}", bits, group, packed_input=True)
    name = f"AutoGPTQ INT{bits}, groups of {group}, {symmetric}"
    return int_groups.checkpoint_format(GPTQ, name, gptq_tensors, bits, group)


def _awq_tensors(method: Any) -> ExpertTensors:
    config = method.quant_config
    return tensors("AWQ INT4", config.weight_bits, config.group_size, False)


def _gptq_tensors(method: Any) -> ExpertTensors:
    config = method.quant_config
    label = f"GPTQ INT{config.weight_bits}"
    return tensors(label, config.weight_bits, config.group_size, True)


def _grouped(method: Any) -> bool:
    return method.quant_config.group_size > 0


AWQ = KimiK3Format(
    name="awq",
    title="AutoAWQ INT4",
    vllm_methods=("AutoAWQMoEMethod",),
    loads_as="AutoAWQMoEMethod",
    partition_rule=int_groups.RULE,
    stored_as="INT4-packed (AutoAWQ qweight/qzeros/scales)",
    moe_backends=MOE_BACKENDS,
    published_config={
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": NOT_CONVERTED,
    },
    recognises=_recognises_awq,
    tensors_of_method=_awq_tensors,
    is_method=_grouped,
)

GPTQ = KimiK3Format(
    name="gptq",
    title="AutoGPTQ INT4",
    vllm_methods=("AutoGPTQMoEMethod",),
    loads_as="AutoGPTQMoEMethod",
    partition_rule=int_groups.RULE,
    stored_as="INT-packed (AutoGPTQ qweight/qzeros/scales)",
    moe_backends=MOE_BACKENDS,
    published_config={
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": True,
        # GPTQModel's per-module override: "-:" skips (leaves BF16) every
        # module but the routed experts.
        "dynamic": {
            r"-:.*(vision_tower|mm_projector|lm_head|self_attn|\.mlp\.|"
            r"shared_experts|routed_expert_(up|down)_proj|"
            r"block_sparse_moe\.gate|_res_proj).*": {}
        },
    },
    recognises=_recognises_gptq,
    tensors_of_method=_gptq_tensors,
    is_method=_grouped,
)
