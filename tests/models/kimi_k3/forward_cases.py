"""The forward-equivalence cases' shared pieces: the selftest's harness
(``vllm_kimi_k3_moe.tools.selftest``) on vLLM's CPU reference kernel, at a
small layer, with each written checkpoint and reference computed once per
session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.selftest.harness import (
    PreparedLayer,
    SelftestCase,
    prepare_layer,
)
from vllm_kimi_k3_moe.tools.selftest.kernels import ReferenceKernel

# Kimi-K3's MoE layer with 4 experts, top-2 (the selftest keeps 2 x top-k),
# 256 wide on the CPU; the real 3072 rows, so TP16 gives each rank 192 and
# TP32 96.
SMALL = {**KIMI_K3_MOE_FIELDS, "num_experts": 4, "num_experts_per_token": 2}
CPU = ReferenceKernel()
# FP32 arithmetic in another summation order than the float64 reference
TOLERANCE = CPU.floor


def small_case(
    fmt: str, topology: Topology, config: dict[str, Any] | None = None
) -> SelftestCase:
    """``fmt`` (with ``config``, or its published quantization config) at
    ``topology`` on Marlin, as ``--moe-backend marlin``."""
    return SelftestCase(fmt, topology, text_config=SMALL, quantization_config=config)


def layer_cache(
    directory: Callable[[str], Path],
) -> Callable[[SelftestCase], PreparedLayer]:
    """``case -> PreparedLayer``, each format and config written once;
    ``directory(name)`` makes a fresh directory."""
    prepared: dict[str, PreparedLayer] = {}

    def layer(case: SelftestCase) -> PreparedLayer:
        key = f"{case.quantization}-{case.config()!r}"
        if key not in prepared:
            prepared[key] = prepare_layer(case, CPU, directory(case.quantization))
        return prepared[key]

    return layer
