"""Per-GPU routed-expert memory of Kimi-K3 on native MXFP4 + Marlin, without EP.

Builds vLLM 0.33.0's real ``KimiMoE`` for rank 0 of TP8/TP16/TP32 on the
``meta`` device, unpatched and with this plugin, and sums the bytes of the
routed-expert parameters it allocates (x 92 MoE layers).

    python benchmarks/expert_memory.py
"""

from __future__ import annotations

import importlib
import time

import torch

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.kimi_k3_text_config import NUM_MOE_LAYERS, kimi_k3_text_config
from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import upstream_kimi_moe
from vllm_kimi_k3_moe.simulated_rank import (
    Topology,
    build_kimi_moe_layer,
    marlin_without_gpu,
    rank_vllm_config,
    simulated_rank,
)


def routed_expert_bytes(moe: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the routed-expert parameters, per-rank intermediate size)."""
    experts = moe.experts.routed_experts
    total = sum(
        p.numel() * p.element_size()
        for name, p in experts.named_parameters()
        if name.startswith(("w13_", "w2_"))
    )
    return total, experts.intermediate_size_per_partition


def build(cls: type, topology: Topology) -> torch.nn.Module:
    with marlin_without_gpu(), simulated_rank(topology):
        return build_kimi_moe_layer(
            cls, kimi_k3_text_config(), rank_vllm_config(topology)
        )


def main() -> None:
    start = time.perf_counter()
    vllm_kimi_k3_moe.register()
    model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    print(f"vLLM Kimi-K3 import: {time.perf_counter() - start:.1f} s")
    header = f"{'TP':>4} {'upstream I/rank':>16} {'fixed I/rank':>13}"
    print(header + f" {'upstream GB/GPU':>16} {'fixed GB/GPU':>13}")
    for tp_size in (8, 16, 32):
        topology = Topology(tp_size)
        up_bytes, up_local = routed_expert_bytes(
            build(upstream_kimi_moe(model), topology)
        )
        fix_bytes, fix_local = routed_expert_bytes(build(model.KimiMoE, topology))
        print(
            f"{tp_size:>4} {up_local:>16} {fix_local:>13} "
            f"{up_bytes * NUM_MOE_LAYERS / 1e9:>16.1f} "
            f"{fix_bytes * NUM_MOE_LAYERS / 1e9:>13.1f}"
        )


if __name__ == "__main__":
    main()
