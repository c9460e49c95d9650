"""NVFP4: FP4 values packed two per byte, one float8 scale per 16 values.

Published as compressed-tensors ``nvfp4-pack-quantized``
(``CompressedTensorsW4A4Nvfp4MoEMethod``) and by NVIDIA ModelOpt
(``ModelOptNvFp4FusedMoE``; ``quant_algo`` NVFP4 in ``config.json`` or
``hf_quant_config.json``). Both allocate at the logical size. FlashInfer's
TRT-LLM and CuteDSL kernels, b12x, Marlin and Humming pad it again at weight
preparation (``kernel_rows``), so the plugin allocates what they keep; the
CUTLASS family's weight preparation refuses a gated pad: their rule keeps the
gate/up scale rows whole 128-row tiles.
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.formats.compressed_tensors import (
    ATTENTION,
    ATTENTION_RESIDUALS,
    ROUTER,
    VISION,
    compressed_tensors_config,
)
from vllm_kimi_k3_moe.formats.layouts import (
    SCALE,
    ExpertScalar,
    ExpertTensorLayout,
    ExpertTensors,
)
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    KimiK3Format,
    PartitionRule,
    QuantizationScheme,
)

GROUP = 16  # values per float8 scale
COMPRESSED_TENSORS_FORMAT = "nvfp4-pack-quantized"

WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": GROUP,
    "symmetric": True,
    "dynamic": False,
}
INPUTS = {**WEIGHTS, "dynamic": "local"}
# Every MLP (routed and shared experts, the dense MLP, the latent
# projections) in NVFP4; attention, router, lm_head and the vision tower BF16.
IGNORE = [*VISION, "lm_head", ATTENTION, ROUTER, ATTENTION_RESIDUALS]

# ``swizzle_blockscale`` (quantization/utils/nvfp4_utils.py) lays NVFP4 block
# scales out in tiles of 128 rows; for the kernels below,
# ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` (flashinfer_fp4_moe.py) raises
# NotImplementedError when that adds rows to a gated w13 (2N rows). The test
# suite runs that code to hold this number to it.
SWIZZLE_ROW_TILE = 128
REFUSING_A_PAD = (
    "VLLM_CUTLASS",
    "FLASHINFER_CUTLASS",
    "FLASHINFER_CUTEDSL_BATCHED",
    "FLASHINFER_B12X",
)
MOE_BACKENDS = ("marlin", "cutlass", "flashinfer_cutedsl", "humming")


def sharded(packed_suffix: str) -> tuple[ExpertTensorLayout, ...]:
    """The packed weight and its group scales (the per-tensor global scales
    each format adds are not TP-sharded)."""
    return (
        ExpertTensorLayout(packed_suffix, 2, dtypes=("U8",)),
        ExpertTensorLayout(SCALE, GROUP, dtypes=("F8_E4M3",)),
    )


COMPRESSED_TENSORS_TENSORS = ExpertTensors(
    "NVFP4",
    sharded("weight_packed"),
    (
        ExpertScalar("weight_global_scale", (1,), ("F32",)),
        ExpertScalar("input_global_scale", (1,), ("F32",)),
    ),
)
MODELOPT_TENSORS = ExpertTensors(
    "ModelOpt NVFP4",
    sharded("weight"),
    (
        ExpertScalar("weight_scale_2", (), ("F32",)),
        ExpertScalar("input_scale", (), ("F32",)),
    ),
)


def _accepts(method: Any, hidden: int, n: int) -> bool:
    if method.nvfp4_backend.name not in REFUSING_A_PAD:
        return True  # the others zero-pad at weight prep (64-row alignment)
    return (2 * n) % SWIZZLE_ROW_TILE == 0


def _group(method: Any) -> int:
    return GROUP


RULE = PartitionRule(
    "swizzle_blockscale row tiles on CUTLASS-family kernels",
    accepts=_accepts,
    row_group=_group,
)
GROUP_UNIT = "NVFP4 scale groups"


def _recognises_compressed_tensors(
    scheme: QuantizationScheme,
) -> CheckpointFormat | None:
    if (scheme.quant_method, scheme.ct_format) != (
        "compressed-tensors",
        COMPRESSED_TENSORS_FORMAT,
    ):
        return None
    return CheckpointFormat(
        COMPRESSED_TENSORS,
        f"compressed-tensors {COMPRESSED_TENSORS_FORMAT}",
        COMPRESSED_TENSORS_TENSORS,
        GROUP,
        GROUP_UNIT,
    )


def _recognises_modelopt(scheme: QuantizationScheme) -> CheckpointFormat | None:
    if (scheme.quant_method, scheme.quant_algo) != ("modelopt", "NVFP4"):
        return None
    return CheckpointFormat(
        MODELOPT, "ModelOpt NVFP4", MODELOPT_TENSORS, GROUP, GROUP_UNIT
    )


COMPRESSED_TENSORS = KimiK3Format(
    name="nvfp4",
    title="compressed-tensors NVFP4",
    vllm_methods=("CompressedTensorsW4A4Nvfp4MoEMethod",),
    loads_as="CompressedTensorsW4A4Nvfp4MoEMethod",
    partition_rule=RULE,
    stored_as="NVFP4-packed (compressed-tensors names)",
    moe_backends=MOE_BACKENDS,
    published_config=compressed_tensors_config(
        COMPRESSED_TENSORS_FORMAT, WEIGHTS, INPUTS, IGNORE
    ),
    recognises=_recognises_compressed_tensors,
    tensors_of_method=lambda method: COMPRESSED_TENSORS_TENSORS,
)

MODELOPT = KimiK3Format(
    name="modelopt-nvfp4",
    title="ModelOpt NVFP4",
    vllm_methods=("ModelOptNvFp4FusedMoE",),
    loads_as="ModelOptNvFp4FusedMoE",
    partition_rule=RULE,
    stored_as="NVFP4-packed (ModelOpt names)",
    moe_backends=MOE_BACKENDS,
    published_config={
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": GROUP,
        "kv_cache_scheme": None,
        "producer": {"name": "modelopt"},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": WEIGHTS,
                "input_activations": INPUTS,
            }
        },
        "ignore": [
            "*vision_tower*",
            "*mm_projector*",
            "lm_head",
            "*self_attn*",
            "*block_sparse_moe.gate",
            "*_res_proj",
        ],
    },
    recognises=_recognises_modelopt,
    tensors_of_method=lambda method: MODELOPT_TENSORS,
)
