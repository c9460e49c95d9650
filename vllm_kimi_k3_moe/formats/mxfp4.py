"""MXFP4: the released Kimi-K3 checkpoint, and other compressed-tensors MXFP4.

FP4 values packed two per byte, one E8M0 scale byte per 32 values. The
release is compressed-tensors ``mxfp4-pack-quantized``, which vLLM 0.33.0's
``KimiK3ForConditionalGenerationConfig`` rewrites to its native ``mxfp4``
(``Mxfp4MoEMethod``, which rounds through the MXFP4 sizing oracle itself).
Any other compressed-tensors MXFP4 format reaches
``CompressedTensorsW4A4Mxfp4MoEMethod``, which does not round: its rule asks
the oracle for the kernel the method selected.
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.formats import nvfp4
from vllm_kimi_k3_moe.formats.compressed_tensors import (
    EVERYTHING_BUT_ROUTED_EXPERTS,
    compressed_tensors_config,
    weight_signature,
)
from vllm_kimi_k3_moe.formats.layouts import SCALE, ExpertTensorLayout, ExpertTensors
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    KimiK3Format,
    PartitionRule,
    QuantizationScheme,
    owns_its_padding,
)

VALUES_PER_BYTE = 2  # two 4-bit values per packed byte
BLOCK = 32  # one E8M0 scale byte per 32 values
BLOCK_UNIT = "MXFP4 scale blocks"
RELEASE_FORMAT = "mxfp4-pack-quantized"

# compressed-tensors' description of MXFP4 weights: FP4 in groups of 32
WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "group",
    "group_size": BLOCK,
    "symmetric": True,
    "dynamic": False,
}

TENSORS = ExpertTensors(
    "MXFP4",
    (
        ExpertTensorLayout("weight_packed", VALUES_PER_BYTE, dtypes=("U8",)),
        ExpertTensorLayout(SCALE, BLOCK, dtypes=("U8",)),
    ),
)

# The --moe-backend names vLLM 0.33.0's native MXFP4 method builds Kimi-K3
# with on NVIDIA (its selector, ``select_deepseek_v4_mxfp4_moe_backend``,
# refuses the others for this model; b12x only without expert parallelism).
NATIVE_BACKENDS = ("marlin", "flashinfer_trtllm", "deep_gemm", "humming", "b12x")
# The compressed-tensors MXFP4 method picks its kernel from the GPU, whatever
# --moe-backend says: CUTLASS where the GPU runs it (Blackwell), else Marlin.
COMPRESSED_TENSORS_BACKENDS = ("marlin", "cutlass")


def _recognises_release(scheme: QuantizationScheme) -> CheckpointFormat | None:
    release = ("compressed-tensors", RELEASE_FORMAT)
    if (scheme.quant_method, scheme.ct_format) != release:
        return None
    return CheckpointFormat(
        RELEASE, f"compressed-tensors {RELEASE_FORMAT}", TENSORS, BLOCK, BLOCK_UNIT
    )


def _recognises_compressed_tensors(
    scheme: QuantizationScheme,
) -> CheckpointFormat | None:
    bits, kind, _, group = weight_signature(scheme.expert_weights)
    if (
        scheme.quant_method != "compressed-tensors"
        or scheme.ct_format in (RELEASE_FORMAT, nvfp4.COMPRESSED_TENSORS_FORMAT)
        or (bits, kind, group) != (4, "float", BLOCK)
    ):
        return None
    name = f"compressed-tensors {scheme.ct_format} MXFP4"
    return CheckpointFormat(COMPRESSED_TENSORS, name, TENSORS, BLOCK, BLOCK_UNIT)


def _compressed_tensors_accepts(method: Any, hidden: int, n: int) -> bool:
    """The MXFP4 sizing oracle leaves ``n`` as it is for the method's kernel
    (the method itself does not ask it)."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        mxfp4_round_up_hidden_size_and_intermediate_size,
    )

    backend = (
        Mxfp4MoeBackend.CUTLASS_MXFP4_MXFP4
        if method.use_cutlass_mxfp4
        else method.mxfp4_backend
    )
    _, padded = mxfp4_round_up_hidden_size_and_intermediate_size(
        backend, hidden, n, activation=method.moe.activation
    )
    return padded == n


def _tensors(method: Any) -> ExpertTensors:
    return TENSORS


def _block(method: Any) -> int:
    return BLOCK


RELEASE = KimiK3Format(
    name="mxfp4",
    title="native MXFP4 (the release)",
    vllm_methods=("Mxfp4MoEMethod",),
    loads_as="native MXFP4 (Mxfp4MoEMethod)",
    partition_rule=owns_its_padding(_block),
    stored_as="MXFP4-packed",
    moe_backends=NATIVE_BACKENDS,
    published_config=compressed_tensors_config(
        RELEASE_FORMAT, WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    recognises=_recognises_release,
    tensors_of_method=_tensors,
    # Native MXFP4 names its packed parameter w13_weight; vLLM's Kimi-K3
    # loader renames the checkpoint's weight_packed to it.
    parameter_suffixes={"weight_packed": "weight"},
)

COMPRESSED_TENSORS = KimiK3Format(
    name="ct-mxfp4",
    title="compressed-tensors MXFP4",
    vllm_methods=("CompressedTensorsW4A4Mxfp4MoEMethod",),
    loads_as="CompressedTensorsW4A4Mxfp4MoEMethod",
    partition_rule=PartitionRule(
        "mxfp4_round_up_hidden_size_and_intermediate_size for its kernel",
        accepts=_compressed_tensors_accepts,
        row_group=_block,
    ),
    stored_as="MXFP4-packed",
    moe_backends=COMPRESSED_TENSORS_BACKENDS,
    published_config=compressed_tensors_config(
        "pack-quantized", WEIGHTS, None, EVERYTHING_BUT_ROUTED_EXPERTS
    ),
    recognises=_recognises_compressed_tensors,
    tensors_of_method=_tensors,
)
