"""What the in-tree verification borrows from the plugin project: the one
place that imports it (those modules may move; only this file follows them).

None of these patch vLLM. They pose a CPU process as one rank of a GPU
deployment (``simulated_rank``), let vLLM pick each MoE kernel as on its GPU
(``moe_kernels_on_their_gpu``), and describe Kimi-K3's published checkpoint
formats: each format's vLLM quantization config and its routed-expert
checkpoint tensors, with seeded non-zero data. The regression suite's
tables of expected behaviour (partitions per format and topology, FP8 block
and NVFP4 row placement) and its traced-checkpoint helpers come from here
too, so the in-tree form is held to the same numbers as the plugin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tests.models.kimi_k3.format_checkpoints import FORMAT_TENSORS, tensor_data
from tests.models.kimi_k3.gpu_stand_ins import uninitialised_memory_reads
from tests.models.kimi_k3.kimi_k3_checkpoint import KimiK3Spec, nonzero_bytes
from tests.models.kimi_k3.kimi_k3_formats import (
    PUBLISHED_FORMATS,
    UNCOVERED_FORMAT,
)
from tests.models.kimi_k3.kimi_k3_formats import (
    format_vllm_config as _format_vllm_config,
)
from tests.models.kimi_k3.test_fp8_block_and_nvfp4_loading import (
    CASES as PLACEMENTS,
)
from tests.models.kimi_k3.test_fp8_block_and_nvfp4_loading import (
    IDS as PLACEMENT_IDS,
)
from tests.models.kimi_k3.test_fp8_block_and_nvfp4_loading import (
    expected_placement,
)
from tests.models.kimi_k3.test_never_worse_than_vllm_alone import (
    ALIGNED_TOPOLOGIES,
    PARTITIONS,
    TOPOLOGIES,
)
from tests.models.kimi_k3.traced_checkpoint import (
    checkpoint_indices,
    digit_planes,
    load_and_decode,
)
from vllm_kimi_k3_moe.tools.build import rank as _rank
from vllm_kimi_k3_moe.tools.build.stand_ins import moe_kernels_on_their_gpu
from vllm_kimi_k3_moe.tools.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.topology import Topology as _Topology

__all__ = [
    "ALIGNED_TOPOLOGIES",
    "PARTITIONS",
    "PLACEMENTS",
    "PLACEMENT_IDS",
    "PUBLISHED_FORMATS",
    "TOPOLOGIES",
    "UNCOVERED_FORMAT",
    "Topology",
    "checkpoint_indices",
    "digit_planes",
    "expected_placement",
    "expert_checkpoint",
    "format_vllm_config",
    "kimi_k3_text_config",
    "load_and_decode",
    "moe_kernels_on_their_gpu",
    "plugin_package",
    "simulated_rank",
    "uninitialised_memory_reads",
]


@dataclass(frozen=True)
class Topology:
    """One rank of a TP (x DP) topology, with or without expert parallelism,
    as the verification names it; ``rank`` is the plugin's form of it."""

    tp_size: int
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False

    @property
    def rank(self) -> _rank.Rank:
        topology = _Topology(
            self.tp_size, dp_size=self.dp_size, expert_parallel=self.expert_parallel
        )
        return _rank.Rank(topology, tp_rank=self.tp_rank, dp_rank=self.dp_rank)


def _rank_of(topology: Any) -> Any:
    """A ``Topology`` here, or the suite's (its rank 0), as the plugin's."""
    return topology.rank if isinstance(topology, Topology) else topology


@contextlib.contextmanager
def simulated_rank(topology: Any) -> Iterator[None]:
    """Pose this process as ``topology``'s rank (the plugin's stand-in)."""
    with _rank.simulated_rank(_rank_of(topology)):
        yield


def format_vllm_config(topology: Any, fmt: str, moe_backend: str) -> Any:
    """The suite's ``VllmConfig`` for one rank of ``topology`` in ``fmt``."""
    return _format_vllm_config(_rank_of(topology), fmt, moe_backend)


def kimi_k3_text_config(**overrides: Any) -> Any:
    """Kimi-K3's MoE text config as vLLM's ``KimiLinearConfig``, with
    ``overrides``."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    return KimiLinearConfig(**{**KIMI_K3_MOE_FIELDS, **overrides})


# The plugin's top-level package: a class from it in KimiMoE's MRO means the
# plugin patched the model.
plugin_package = "vllm_kimi_k3_moe"

# MXFP4 (native and compressed-tensors): FP4 packed two per byte along the
# input dimension, one E8M0 scale byte per 32 values.
_MXFP4_TENSORS = [
    ("weight_packed", lambda rows, cols: (rows, cols // 2), "U8"),
    ("weight_scale", lambda rows, cols: (rows, cols // 32), "U8"),
]
_TENSORS = {"mxfp4": _MXFP4_TENSORS, "ct-mxfp4": _MXFP4_TENSORS, **FORMAT_TENSORS}


def expert_checkpoint(
    fmt: str, layer: int, num_experts: int, hidden: int, intermediate: int
) -> dict[str, Any]:
    """Every routed-expert tensor of MoE layer ``layer`` in format ``fmt``,
    by checkpoint key (``language_model.layers.{layer}.block_sparse_moe.
    experts.{e}.{w1|w3|w2}.{suffix}``), seeded per tensor, never zero."""
    spec = KimiK3Spec(
        routed_expert_hidden_size=hidden,
        moe_intermediate_size=intermediate,
        num_experts=num_experts,
    )
    tensors: dict[str, Any] = {}
    seed = 0
    for expert in range(num_experts):
        for projection in ("w1", "w3", "w2"):
            rows, cols = (
                (hidden, intermediate) if projection == "w2" else (intermediate, hidden)
            )
            for suffix, shape, dtype in _TENSORS[fmt]:
                name = (
                    f"language_model.layers.{layer}.block_sparse_moe.experts."
                    f"{expert}.{projection}.{suffix}"
                )
                if dtype == "U8" and fmt in ("mxfp4", "ct-mxfp4"):
                    tensors[name] = nonzero_bytes(shape(rows, cols), seed)
                else:
                    tensors[name] = tensor_data(
                        spec, name, dtype, shape(rows, cols), seed
                    )
                seed += 1
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    return tensors
