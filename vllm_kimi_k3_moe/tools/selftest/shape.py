"""The MoE layer ``selftest`` builds: Kimi-K3's expert shapes, fewer experts.

Each rank gets its real partition of the real intermediate size (3072) at
the real routed width (3584, what the experts see), with top-k routing as
published; only the number of experts is reduced, to the fewest that let
every expert of a top-k token be distinct twice over (at least 2 x top-k),
so that every rank fits one GPU in turn. On a CPU the width is reduced too
(``CPU_WIDTH``), for time: the rows each rank holds are the same.

Plain Python (no torch, no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.topology import Topology

# On a CPU, vLLM's reference kernel and the float64 reference at 3584 wide
# take minutes per format; 256 is a width every format and kernel accepts
# (Marlin's MXFP4 hidden multiple, FP8 blocks of 128) and what the forward
# tests use. The intermediate size and so every rank's partition are real.
CPU_WIDTH = 256
# The model's residual width on a CPU: the router and the latent
# projections read it, the routed experts never do (they are not run).
# 8 per attention head of 96: vLLM's config wants an even head width.
CPU_HIDDEN = 768


@dataclass(frozen=True)
class MoeShape:
    """One routed-expert layer as the selftest builds it."""

    width: int  # routed_expert_hidden_size: the experts' input and output
    intermediate: int  # moe_intermediate_size: rows per expert, all ranks
    experts: int  # routed experts built (of the model's)
    top_k: int  # experts per token
    hidden: int  # the residual width the router reads (never run)


def reduced_experts(text_config: dict[str, Any], topology: Topology) -> int:
    """The fewest experts, at least 2 x top-k, that the expert-parallel GPUs
    (with ``--ep``) share as they share the model's: evenly where the
    model's split evenly, else with the same remainder (a pruned
    checkpoint's 806 over 8 GPUs: 6 of them one expert heavier), so that
    vLLM's uneven placement is what runs; never more than the model has."""
    top_k, experts = text_config["num_experts_per_token"], text_config["num_experts"]
    step = topology.moe_group if topology.expert_parallel else 1
    wanted = -(-2 * top_k // step) * step + experts % step
    return min(wanted, experts)


def moe_shape(
    text_config: dict[str, Any], topology: Topology, *, reduced_width: bool
) -> MoeShape:
    """The layer for ``topology``; ``reduced_width``: a CPU's (``CPU_WIDTH``)."""
    width = text_config.get("routed_expert_hidden_size") or text_config["hidden_size"]
    return MoeShape(
        width=CPU_WIDTH if reduced_width else width,
        intermediate=text_config["moe_intermediate_size"],
        experts=reduced_experts(text_config, topology),
        top_k=text_config["num_experts_per_token"],
        hidden=CPU_HIDDEN if reduced_width else text_config["hidden_size"],
    )
