"""Render ``MoeMemoryPlan`` results: the plain-text table and the JSON document."""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm_kimi_k3_moe.plan import MoeMemoryPlan

GB = 10**9


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / GB:.1f}"


def _gb_per_layer(num_bytes: int) -> str:
    return f"{num_bytes / GB:.3f}"


QUANTIZATION_NAMES = {
    "mxfp4": "native MXFP4",
    "compressed-tensors": "compressed-tensors MXFP4",
}


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


def table(plans: Sequence[MoeMemoryPlan], gpu_memory_gib: float | None) -> str:
    """One row per deployment; per-GPU figures, GB = 10^9 bytes."""
    layers = plans[0].moe_layers
    groups = [
        ("", ["config", "GPUs", "experts"]),
        ("I per rank", ["logical", "upstream", "fixed"]),
        ("routed GB per layer", ["upstream", "fixed", "floor"]),
        (f"routed GB, {layers} layers", ["upstream", "fixed", "floor"]),
        (f"{layers} layers", ["shared GB", "latent GB"]),
    ]
    if gpu_memory_gib is not None:
        groups.append((f"fits {gpu_memory_gib:g} GiB", ["upstream", "fixed"]))
    rows = []
    for p in plans:
        totals = p.all_moe_layers
        row = [
            p.deployment.label(),
            str(p.deployment.gpus),
            str(p.fixed.local_experts),
            str(p.logical_intermediate_per_rank),
            str(p.upstream.intermediate_per_rank),
            str(p.fixed.intermediate_per_rank),
            _gb_per_layer(p.upstream.routed_bytes),
            _gb_per_layer(p.fixed.routed_bytes),
            _gb_per_layer(p.floor_routed_bytes),
            _gb(totals["upstream_routed_bytes"]),
            _gb(totals["fixed_routed_bytes"]),
            _gb(totals["floor_routed_bytes"]),
            _gb(totals["shared_bytes"]),
            _gb(totals["latent_bytes"]),
        ]
        if gpu_memory_gib is not None:
            fits = p.fits(gpu_memory_gib)
            row += ["yes" if fits[which] else "no" for which in ("upstream", "fixed")]
        rows.append(row)

    d = plans[0].deployment
    notes = [
        "experts: routed experts per GPU. I per rank: routed-expert intermediate",
        "size per GPU: the logical slice, what vLLM 0.33.0 allocates (upstream)",
        "and what it allocates with this plugin (fixed). floor: the routed experts",
        "at exactly the logical size. shared, latent: shared experts and the",
        "latent MoE projections (same upstream and fixed).",
    ]
    if gpu_memory_gib is not None:
        notes += [
            f"fits: all MoE-layer weights (routed, shared, latent, router) in "
            f"{gpu_memory_gib:g} GiB;",
            "attention, dense layers, KV cache and activations are not counted.",
        ]
    return "\n".join(
        [
            f"Kimi-K3 MoE weights per GPU: {QUANTIZATION_NAMES[d.quantization]} "
            f"on {d.backend}, {layers} MoE layers, GB = 10^9 bytes",
            "",
            *_render(groups, rows),
            "",
            *notes,
        ]
    )


def as_json(plans: Sequence[MoeMemoryPlan], gpu_memory_gib: float | None) -> str:
    documents = []
    for p in plans:
        document = p.to_dict()
        if gpu_memory_gib is not None:
            document["fits"] = {
                "gpu_memory_gib": gpu_memory_gib,
                **p.fits(gpu_memory_gib),
            }
        documents.append(document)
    return json.dumps(documents, indent=2)
