"""How one Kimi-K3 routed expert is stored in each checkpoint format.

Plain Python (no torch, no vLLM), so the checkpoint preflight can use it
without paying for either import; the strict expert loader checks the same
shapes on the tensors it receives.

Vocabulary: a *projection* is w1 (gate), w3 (up) or w2 (down); a *suffix* is
what follows it in a checkpoint key (``weight``, ``weight_packed``,
``weight_scale``). w1 and w3 are ``[intermediate, hidden]`` and w2
``[hidden, intermediate]`` before quantization; formats store the input
(last) dimension packed several values per element, or reduced to one scale
per group, and FP8 blocks reduce the output dimension too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
MXFP4_VALUES_PER_BYTE = 2  # two 4-bit values per packed byte
MXFP4_BLOCK = 32  # one E8M0 scale byte per 32 values
SCALE = "weight_scale"


@dataclass(frozen=True)
class ExpertTensorLayout:
    """One TP-sharded checkpoint tensor of a routed expert projection."""

    suffix: str  # in the checkpoint key
    input_per_element: int = 1  # input values per stored element (pack, group)
    output_per_element: int = 1  # output values per stored element (blocks)
    dtypes: tuple[str, ...] = ()  # safetensors dtypes it may have; () any

    def shape(self, projection: str, hidden: int, intermediate: int) -> tuple[int, int]:
        """Checkpoint shape of this tensor of ``projection``."""
        rows, cols = (
            (hidden, intermediate) if projection == "w2" else (intermediate, hidden)
        )
        return (
            math.ceil(rows / self.output_per_element),
            math.ceil(cols / self.input_per_element),
        )


FLOAT_SCALES = ("BF16", "F16", "F32")  # scales stored in a float dtype


def mxfp4() -> tuple[ExpertTensorLayout, ...]:
    """FP4 packed two per byte, one E8M0 scale byte per 32 values."""
    return (
        ExpertTensorLayout("weight_packed", MXFP4_VALUES_PER_BYTE, dtypes=("U8",)),
        ExpertTensorLayout(SCALE, MXFP4_BLOCK, dtypes=("U8",)),
    )


def fp8_block(block_out: int, block_in: int) -> tuple[ExpertTensorLayout, ...]:
    """float8 weights, one scale per ``block_out x block_in`` block."""
    return (
        ExpertTensorLayout("weight", dtypes=("F8_E4M3",)),
        ExpertTensorLayout(SCALE, block_in, block_out, dtypes=FLOAT_SCALES),
    )


def nvfp4(packed_suffix: str) -> tuple[ExpertTensorLayout, ...]:
    """FP4 packed two per byte, one float8 scale per 16 values (the per-tensor
    global scales are not TP-sharded: ``ExpertScalar``)."""
    return (
        ExpertTensorLayout(packed_suffix, 2, dtypes=("U8",)),
        ExpertTensorLayout(SCALE, 16, dtypes=("F8_E4M3",)),
    )


def int_packed(num_bits: int, group_size: int) -> tuple[ExpertTensorLayout, ...]:
    """Integers packed into int32 (32 // num_bits per element), one scale per
    group of ``group_size`` input values."""
    return (
        ExpertTensorLayout("weight_packed", 32 // num_bits, dtypes=("I32",)),
        ExpertTensorLayout(SCALE, group_size, dtypes=FLOAT_SCALES),
    )


def unquantized() -> tuple[ExpertTensorLayout, ...]:
    return (ExpertTensorLayout("weight", dtypes=("BF16",)),)


@dataclass(frozen=True)
class ExpertScalar:
    """A per-projection checkpoint tensor that is not TP-sharded (a global or
    input scale, a stored shape): every rank loads it whole."""

    suffix: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointFormat:
    """How a Kimi-K3 checkpoint format stores each routed expert projection."""

    name: str  # as the summary names it
    loads_as: str  # the vLLM method its experts get
    sharded: tuple[ExpertTensorLayout, ...]
    scalars: tuple[ExpertScalar, ...] = ()
    # plan's quantization path for the format, None where plan cannot size it
    plan_path: str | None = None

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in (*self.sharded, *self.scalars))
