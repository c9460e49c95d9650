"""``check --json``: the report for CI, as one JSON object on stdout.

Keys: ``checkpoint``, ``status`` (the exit status: 0 clean, 1 problems),
``headline`` (the cause, or null), ``format``, ``topology``, ``shards``,
``bytes``, ``layers``, ``expert_tensors``, ``per_gpu`` (one entry per GPU
of the deployment, each its pipeline ``stage`` and its place ``gpu`` in that
stage's MoE group: ``experts`` and ``rows`` as half-open [start, end) ranges
and the routed-expert checkpoint bytes that GPU loads, over its stage's MoE
layers: every MoE layer without ``--pp``), ``summary``
(problems per kind and per shard), ``problems`` (every one: kind, subject,
detail, shard), with ``--pp`` ``stages`` (each stage's ``layers`` [start,
end), ``moe_layers`` and ``per_gpu``) and, with ``--moe-backend``,
``allocation`` (its ``routed_bytes_per_gpu``: the heaviest GPU's, with
``--pp`` its stage's MoE layers only, each stage's in ``by_stage``; its
``planned_for``: the GPU vLLM's model was built as on, as in plan's JSON), and
``aiter_situv2``: the ``AITER_SITUV2_*`` variables the server's environment
sets that vLLM replaces, what it sets and what to set instead (null: none).
Encoded by msgspec: a release-sized checkpoint with every expert tensor
wrong is about a million problems.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_kimi_k3_moe.tools.check.aiter_environment import Situv2Replaced
from vllm_kimi_k3_moe.tools.check.preflight import PreflightReport
from vllm_kimi_k3_moe.tools.check.report import routed_bytes_by_stage
from vllm_kimi_k3_moe.tools.check.sharding import GpuShare, StageShare
from vllm_kimi_k3_moe.tools.plan.planner import MoeMemoryPlan


def as_dict(report: PreflightReport) -> dict[str, Any]:
    layout, topology, problems = report.layout, report.parallelism, report.problems
    return {
        "checkpoint": str(report.directory),
        "status": report.status,
        "headline": report.mismatch,
        "format": {
            "name": layout.format.format.name,
            "recognised_as": layout.format.name,
            "declared_in": layout.declared_in,
            "loads_as": layout.format.loads_as,
        },
        "topology": {
            "tp_size": topology.tp_size,
            "dp_size": topology.dp_size,
            "expert_parallel": topology.expert_parallel,
            "pp_size": topology.pp_size,
            "dcp_size": topology.dcp_size,
            "gpus": topology.gpus,
        },
        "shards": {"in_checkpoint": report.shards, "headers_read": report.headers_read},
        "bytes": {
            "referenced": report.total_bytes,
            "routed_experts": report.expert_bytes,
        },
        "layers": {"moe": layout.main_layers, "mtp": layout.mtp_layers},
        "expert_tensors": {
            "per_expert": [key for key, _ in layout.contracts()],
            "expected": report.expert_tensors_expected,
            "found": report.expert_tensors_found,
        },
        "adapter_tensors": {
            "quantized": layout.adapters_quantized,
            "per_layer": [key for key, _ in layout.adapter_contracts()],
            "expected": report.adapter_tensors_expected,
            "found": report.adapter_tensors_found,
        },
        # each GPU loads its own stage's MoE layers, not the model's
        "per_gpu": (
            [
                {"stage": stage.stage, **share}
                for stage in report.stages
                for share in _per_gpu(stage.shares)
            ]
            if topology.pp_size > 1
            else [{"stage": 0, **share} for share in _per_gpu(report.shares)]
        ),
        "summary": {
            "problems": len(problems),
            "by_kind": problems.counts(),
            "by_shard": {
                shard: dict(kinds) for shard, kinds in problems.shards_by_count()
            },
        },
        "problems": list(problems),
        **(
            {
                "stages": [
                    {
                        "stage": stage.stage,
                        "layers": list(stage.layers),
                        "moe_layers": stage.moe_layers,
                        "per_gpu": _per_gpu(stage.shares),
                    }
                    for stage in report.stages
                ]
            }
            if topology.pp_size > 1
            else {}
        ),
    }


def _per_gpu(shares: list[GpuShare]) -> list[dict[str, Any]]:
    return [
        {
            "gpu": share.gpu,
            "experts": list(share.experts),
            "rows": list(share.rows),
            "routed_expert_bytes": share.expert_bytes,
        }
        for share in shares
    ]


def allocation_dict(
    plan: MoeMemoryPlan, stages: list[StageShare], planned_for: dict[str, Any]
) -> dict[str, Any]:
    """``routed_bytes_per_gpu``: what the heaviest GPU allocates (with
    pipeline stages, its stage's MoE layers only; ``by_stage`` has each)."""
    by_stage = routed_bytes_by_stage(plan, stages)
    heaviest = max(by_stage, key=lambda pair: pair[0])
    document = {
        "planned_for": planned_for,
        "backend": plan.deployment.backend,
        "moe_layers": plan.moe_layers,
        "intermediate_per_rank": {
            "plugin": plan.fixed.intermediate_per_rank,
            "upstream": plan.upstream and plan.upstream.intermediate_per_rank,
        },
        "routed_bytes_per_gpu": {"plugin": heaviest[0], "upstream": heaviest[1]},
        "upstream_refusal": plan.upstream_refusal,
    }
    if stages:
        document["routed_bytes_per_gpu"]["by_stage"] = [
            {"stage": s.stage, "plugin": fixed, "upstream": alone}
            for s, (fixed, alone) in zip(stages, by_stage, strict=True)
        ]
    return document


def as_json(
    report: PreflightReport,
    situv2: Situv2Replaced | None = None,
    plan: MoeMemoryPlan | None = None,
    planned_for: dict[str, Any] | None = None,
) -> bytes:
    """``plan``: vLLM's allocation (``--moe-backend``), built as on the GPU
    ``planned_for`` says."""
    document = as_dict(report)
    document["aiter_situv2"] = None if situv2 is None else situv2.to_dict()
    if plan is not None:
        assert planned_for is not None
        stages = report.stages if report.parallelism.pp_size > 1 else []
        document["allocation"] = allocation_dict(plan, stages, planned_for)
    return msgspec.json.encode(document) + b"\n"  # Problems are Structs
