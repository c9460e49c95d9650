"""How one routed expert projection is stored in a checkpoint: value types.

Plain Python (no torch, no vLLM), so the checkpoint preflight can use it
without paying for either import. ``ExpertTensors.contracts`` is the one
tensor contract: ``check`` holds each shard header's entry to it and the
strict expert loader each tensor it receives, so that what one refuses the
other refuses too.

Vocabulary: a *projection* is w1 (gate), w3 (up) or w2 (down); a *suffix* is
what follows it in a checkpoint key (``weight``, ``weight_packed``,
``weight_scale``). w1 and w3 are ``[intermediate, hidden]`` and w2
``[hidden, intermediate]`` before quantization; formats store the input
(last) dimension packed several values per element, or reduced to one scale
per group, and FP8 blocks reduce the output dimension too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
# vLLM's per-expert parameter stems and the projections each holds, in order
# along its rows (w1 and w3 fused into ``w13_*``)
PARAMETER_PROJECTIONS = {"w13": ("w1", "w3"), "w2": ("w2",)}
SCALE = "weight_scale"
FLOAT_SCALES = ("BF16", "F16", "F32")  # scales stored in a float dtype

# safetensors dtype -> the torch dtype a loaded tensor of it has (by name:
# this module imports no torch).
TORCH_DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}
# torch dtype name -> safetensors dtype: what a loaded tensor was stored as
SAFETENSORS_DTYPES = {torch: stored for stored, torch in TORCH_DTYPE_NAMES.items()}


def safetensors_dtype(torch_dtype_name: str) -> str:
    """The safetensors name of a torch dtype (``"torch.uint8"`` or
    ``"uint8"`` -> ``"U8"``); an unknown one as torch names it."""
    name = torch_dtype_name.removeprefix("torch.")
    return SAFETENSORS_DTYPES.get(name, name)


@dataclass(frozen=True)
class ExpertTensorLayout:
    """One TP-sharded checkpoint tensor of a routed expert projection."""

    suffix: str  # in the checkpoint key
    input_per_element: int = 1  # input values per stored element (pack, group)
    output_per_element: int = 1  # output values per stored element (blocks)
    dtypes: tuple[str, ...] = ()  # safetensors dtypes it may have; () any
    # stored input-first, [input, output] (AutoAWQ's and AutoGPTQ's layout)
    transposed: bool = False

    def shape(self, projection: str, hidden: int, intermediate: int) -> tuple[int, int]:
        """Checkpoint shape of this tensor of ``projection``."""
        rows, cols = (
            (hidden, intermediate) if projection == "w2" else (intermediate, hidden)
        )
        shape = (
            math.ceil(rows / self.output_per_element),
            math.ceil(cols / self.input_per_element),
        )
        return shape[::-1] if self.transposed else shape


@dataclass(frozen=True)
class ExpertScalar:
    """A per-projection checkpoint tensor that is not TP-sharded (a global or
    input scale, a stored shape): every rank loads it whole."""

    suffix: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class TensorContract:
    """What one checkpoint tensor of one routed expert projection must be:
    its logical shape and the safetensors dtypes it may have. ``check`` and
    the strict loader both hold tensors to it (``breaches``), so what one
    refuses the other refuses too."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # () any

    def fits(self, shape: tuple[int, ...], dtype: str) -> bool:
        """Shape (a tuple) and dtype (as safetensors names it) both fit:
        the one test of every tensor, kept to two comparisons because
        ``check`` runs it half a million times."""
        return shape == self.shape and (not self.dtypes or dtype in self.dtypes)

    def breaches(self, shape: Sequence[int], dtype: str) -> list[Breach]:
        """How a tensor of ``shape`` and ``dtype`` (safetensors' name:
        ``safetensors_dtype``) breaks the contract: nothing if it fits."""
        found: list[Breach] = []
        if tuple(shape) != self.shape:
            found.append(Breach("shape", tuple(shape), self.shape))
        if self.dtypes and dtype not in self.dtypes:
            found.append(Breach("dtype", dtype, self.dtype_text))
        return found

    @property
    def dtype_text(self) -> str:
        return " or ".join(self.dtypes) or "any dtype"


@dataclass(frozen=True)
class Breach:
    """One way a tensor breaks its contract: ``kind`` "shape" (found and
    expected are shapes) or "dtype" (safetensors dtype names)."""

    kind: str
    found: Any
    expected: Any


@dataclass(frozen=True)
class ExpertTensors:
    """Every checkpoint tensor of one routed expert projection in a format."""

    label: str  # as loading errors name the format: "MXFP4", "FP8 block"
    sharded: tuple[ExpertTensorLayout, ...]
    scalars: tuple[ExpertScalar, ...] = ()

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in (*self.sharded, *self.scalars))

    def contracts(
        self, hidden: int, intermediate: int
    ) -> dict[tuple[str, str], TensorContract]:
        """(projection, suffix) -> its contract, for every checkpoint tensor
        of one expert, in checkpoint order (w1, w3, w2; sharded first)."""
        contracts = {
            (projection, tensor.suffix): TensorContract(
                tensor.shape(projection, hidden, intermediate), tensor.dtypes
            )
            for projection in PROJECTIONS
            for tensor in self.sharded
        }
        contracts |= {
            (projection, scalar.suffix): TensorContract(scalar.shape, scalar.dtypes)
            for projection in PROJECTIONS
            for scalar in self.scalars
        }
        return contracts
