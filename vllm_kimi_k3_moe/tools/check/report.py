"""What ``vllm-kimi-k3-moe check`` prints for a ``PreflightReport``."""

from __future__ import annotations

from collections import Counter

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats.layouts import PROJECTIONS
from vllm_kimi_k3_moe.tools.check.preflight import PreflightReport, layer_ranges
from vllm_kimi_k3_moe.tools.plan.planner import MoeMemoryPlan


def _bytes(count: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} bytes"


def summary(report: PreflightReport) -> list[str]:
    layout = report.layout
    main, mtp = layout.main_layers, layout.mtp_layers
    suffixes = layout.format.tensors.suffixes
    per_expert = len(PROJECTIONS) * len(suffixes)
    expected = len(layout.layers) * layout.num_experts * per_expert
    lines = [
        f"checkpoint  {report.directory}",
        f"format      {layout.format.name}; vLLM loads its experts with "
        f"{layout.format.loads_as}",
        f"shards      {report.shards} headers read (no tensor data), "
        f"{_bytes(report.total_bytes)} referenced, {_bytes(report.expert_bytes)} "
        "of it routed experts",
        f"layers      {len(main)} MoE layers ({layer_ranges(main)})"
        + (f" + {len(mtp)} MTP ({layer_ranges(mtp)})" if mtp else ""),
        f"experts     {layout.num_experts} per layer x {per_expert} tensors "
        f"(w1, w3, w2 x {', '.join(suffixes)}): {expected} expected, "
        f"{report.expert_tensors_checked} found and checked",
    ]
    share = report.share
    topology = report.parallelism.label("sentence")
    if share is None:
        lines.append(f"per GPU     {topology}: does not divide the model (below)")
    elif share.expert_parallel:
        lines.append(
            f"per GPU     {topology}: {share.experts} of {layout.num_experts} "
            f"experts (GPU r: experts {share.experts}r to {share.experts}r+"
            f"{share.experts - 1}), all {share.intermediate} intermediate rows; "
            f"{_bytes(share.expert_bytes)} of routed-expert checkpoint data"
        )
    else:
        lines.append(
            f"per GPU     {topology}: all {share.experts} experts, "
            f"{share.intermediate} of {layout.intermediate} intermediate rows "
            f"each (GPU r: rows {share.intermediate}r to {share.intermediate}r+"
            f"{share.intermediate - 1}); {_bytes(share.expert_bytes)} of "
            "routed-expert checkpoint data"
        )
    return lines


def allocation(plan: MoeMemoryPlan) -> list[str]:
    """vLLM's allocation for the deployment, upstream and with the plugin."""
    totals = plan.all_moe_layers
    return [
        f"allocated   on {plan.deployment.backend}, by {VLLM}'s own layer: "
        f"{plan.fixed.intermediate_per_rank} intermediate rows per expert with "
        f"this plugin (upstream {plan.upstream.intermediate_per_rank}); routed "
        f"experts {_bytes(totals['fixed_routed_bytes'])} per GPU over the "
        f"{plan.moe_layers} main-model MoE layers (upstream "
        f"{_bytes(totals['upstream_routed_bytes'])})"
    ]


def verdict(report: PreflightReport) -> list[str]:
    problems = report.problems
    if not problems:
        return [
            "OK          every routed-expert tensor is present once, with its "
            "format's dtype and shape, and the topology divides the model"
        ]
    counts = Counter(problem.kind for problem in problems)
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return [
        f"{len(problems)} problem{'s' if len(problems) > 1 else ''} ({kinds}):",
        *(f"  {problem}" for problem in problems),
        f"FAILED      {len(problems)} problem{'s' if len(problems) > 1 else ''}: "
        "fix the checkpoint (or the topology) before launching vLLM",
    ]
