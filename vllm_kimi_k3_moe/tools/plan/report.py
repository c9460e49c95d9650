"""Render ``DeploymentPlan`` results: the plain-text table and the JSON document."""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan

GB = 10**9


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / GB:.1f}"


def _gb_per_layer(num_bytes: int) -> str:
    return f"{num_bytes / GB:.3f}"


def _render(groups: list[tuple[str, list[str]]], rows: list[list[str]]) -> list[str]:
    """Columns under spanning group labels; first column left, others right."""
    names = [name for _, columns in groups for name in columns]
    widths = [max(len(n), *(len(r[i]) for r in rows)) for i, n in enumerate(names)]
    spans, start = [], 0
    for label, columns in groups:
        end = start + len(columns)
        span = sum(widths[start:end]) + 2 * (len(columns) - 1)
        if len(label) > span:
            widths[end - 1] += len(label) - span
            span = len(label)
        spans.append(label.center(span))
        start = end

    def line(cells: Sequence[str]) -> str:
        padded = [cells[0].ljust(widths[0])]
        padded += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(padded).rstrip()

    return ["  ".join(spans).rstrip(), line(names), *(line(r) for r in rows)]


def table(plans: Sequence[DeploymentPlan]) -> str:
    """One row per deployment; per-GPU figures, GB = 10^9 bytes."""
    first = plans[0]
    layers = first.moe.moe_layers
    budget, serving = first.budget, first.serving
    groups = [
        ("", ["config", "GPUs", "experts"]),
        ("I per rank", ["logical", "upstream", "fixed"]),
        ("routed GB per layer", ["upstream", "fixed", "floor"]),
        (f"routed GB, {layers} layers", ["upstream", "fixed", "floor"]),
        ("whole model GB", ["upstream", "fixed"]),
    ]
    if budget is not None:
        groups += [
            (f"fits {budget.gpu_memory_gib:g} GiB", ["upstream", "fixed"]),
            ("KV cache tokens", ["upstream", "fixed"]),
            (f"requests of {serving.max_model_len}", ["upstream", "fixed"]),
        ]
    rows = []
    for p in plans:
        moe, totals = p.moe, p.moe.all_moe_layers
        row = [
            p.deployment.label(),
            str(p.deployment.gpus),
            str(moe.fixed.local_experts),
            str(moe.logical_intermediate_per_rank),
            str(moe.upstream.intermediate_per_rank),
            str(moe.fixed.intermediate_per_rank),
            _gb_per_layer(moe.upstream.routed_bytes),
            _gb_per_layer(moe.fixed.routed_bytes),
            _gb_per_layer(moe.floor_routed_bytes),
            _gb(totals["upstream_routed_bytes"]),
            _gb(totals["fixed_routed_bytes"]),
            _gb(totals["floor_routed_bytes"]),
            _gb(p.upstream.total_bytes),
            _gb(p.fixed.total_bytes),
        ]
        if budget is not None:
            kv = (p.upstream_kv, p.fixed_kv)
            row += ["yes" if c.tokens else "no" for c in kv]
            row += [f"{c.tokens:,}" for c in kv]
            row += [f"{c.concurrency:.1f}" for c in kv]
        rows.append(row)

    d = first.deployment
    notes = [
        "experts: routed experts per GPU. I per rank: routed-expert intermediate",
        f"size per GPU: the logical slice, what {VLLM} allocates (upstream)",
        "and what it allocates with this plugin (fixed). floor: the routed experts",
        "at exactly the logical size. whole model: every parameter of vLLM's",
        "Kimi-K3 language model on one GPU (embeddings, lm_head, MLA and KDA",
        "attention, dense layer, MoE layers, norms).",
    ]
    if budget is not None:
        kv = first.kv_cache
        notes += [
            f"fits: vLLM takes {budget.utilization:g} of {budget.gpu_memory_gib:g} "
            "GiB (--gpu-memory-utilization), less the weights",
            f"and a {budget.reserve_gib:g} GiB reserve for activations and CUDA "
            "graphs (--reserve-gib, an",
            "estimate); the rest is KV cache, sized by vLLM's own block-pool",
            "planner from the built layers' KV-cache specs. It fits when that",
            f"holds one request of --max-model-len {serving.max_model_len}; "
            "requests: how many of that length.",
            f"KV cache ({serving.kv_cache_dtype}): {kv.mla_bytes_per_token:,} bytes "
            f"per token on every GPU ({kv.mla_layers} MLA layers), plus",
            f"the state of {kv.kda_layers} KDA layers per sequence, split by TP.",
        ]
    return "\n".join(
        [
            f"Kimi-K3 per GPU: {d.format.title} on {d.backend}, "
            f"{layers} MoE layers, GB = 10^9 bytes",
            "",
            *_render(groups, rows),
            "",
            *notes,
        ]
    )


def as_json(plans: Sequence[DeploymentPlan]) -> str:
    documents = []
    for p in plans:
        document = p.to_dict()
        if p.budget is not None:
            assert p.upstream_kv is not None and p.fixed_kv is not None
            document["fits"] = {
                "gpu_memory_gib": p.budget.gpu_memory_gib,
                "upstream": p.upstream_kv.tokens > 0,
                "fixed": p.fixed_kv.tokens > 0,
            }
        documents.append(document)
    return json.dumps(documents, indent=2)
