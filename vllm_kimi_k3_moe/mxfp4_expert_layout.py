"""How one Kimi-K3 routed expert is stored in an MXFP4 checkpoint.

Plain Python (no torch, no vLLM), so the checkpoint preflight can use it
without paying for either import. The strict expert loader checks the same
shapes on the tensors it receives.
"""

from __future__ import annotations

MXFP4_VALUES_PER_BYTE = 2  # two 4-bit values per packed byte
MXFP4_BLOCK = 32  # one E8M0 scale byte per 32 values
PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
SCALE = "weight_scale"


def expert_tensor_shape(
    projection: str, kind: str, hidden: int, intermediate: int
) -> tuple[int, int]:
    """Checkpoint shape of ``projection``'s packed weight (``kind`` weight or
    weight_packed) or its ``weight_scale``: w1/w3 are ``[intermediate,
    hidden]`` and w2 ``[hidden, intermediate]``, with the input (last)
    dimension packed two values per byte or reduced to one scale per 32."""
    per_byte = MXFP4_BLOCK if kind == SCALE else MXFP4_VALUES_PER_BYTE
    if projection == "w2":
        return hidden, intermediate // per_byte
    return intermediate, hidden // per_byte
