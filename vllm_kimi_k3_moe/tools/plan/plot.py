"""``plan --plot FILE.svg``: one GPU's memory in each layout of the answer,
vLLM alone's bar over the plugin's, as a hand-written SVG (no plotting
library): the weights of the heaviest GPU, plan's reserve, and the KV cache
vLLM would allocate in the rest, against the memory vLLM takes of the GPU
(a dashed line). Every figure is one the table prints; sizes in GB."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from vllm_kimi_k3_moe.tools.plan.values import GB, DeploymentPlan

ROW = 22  # px per bar
GAP = 14  # px between layouts
LEFT = 150  # px for the labels
WIDTH = 560  # px for the bars
RIGHT = 100  # px for the verdict after the longest bar
TOP = 64  # px above the first bar (title, legend)
COLOURS = {"weights": "#4c72b0", "reserve": "#b3b3b3", "KV cache": "#55a868"}


def _segments(plan: DeploymentPlan, side: str) -> list[tuple[str, float]] | None:
    """(part, GB) of one bar; None where vLLM alone cannot build it."""
    weights = plan.upstream if side == "upstream" else plan.fixed
    budget = plan.budget
    if weights is None or budget is None:
        return None
    capacity = plan.kv(side)
    kv = max(capacity.available_bytes, 0) if capacity is not None else 0
    return [
        ("weights", weights.total_bytes / GB),
        ("reserve", budget.reserve_bytes / GB),
        ("KV cache", kv / GB),
    ]


def _bar(y: float, scale: float, segments: list[tuple[str, float]]) -> list[str]:
    parts, x = [], float(LEFT)
    for name, size in segments:
        width = size * scale
        if width > 0:
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" '
                f'height="{ROW - 4}" fill="{COLOURS[name]}">'
                f"<title>{name} {size:.1f} GB</title></rect>"
            )
        x += width
    return parts


def _text(x: float, y: float, words: str, anchor: str = "start") -> str:
    shown = escape(words, quote=False)
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{shown}</text>'


def memory_svg(plans: Sequence[DeploymentPlan], title: str) -> str:
    """The figure of ``plans`` (each sized on a GPU: ``budget`` set)."""
    budgets = [plan.budget for plan in plans]
    if not plans or any(budget is None for budget in budgets):
        raise ValueError("--plot needs a GPU size (--gpu NAME or --gpu-memory-gb X)")
    totals = [
        sum(size for _, size in bar)
        for plan in plans
        for bar in (_segments(plan, "upstream"), _segments(plan, "fixed"))
        if bar is not None
    ]
    gpu = max(budget.requested_bytes for budget in budgets if budget) / GB
    scale = WIDTH / max([*totals, gpu])
    height = TOP + len(plans) * (2 * ROW + GAP) + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + RIGHT}" '
        f'height="{height}" font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        _text(8, 18, title),
    ]
    x = float(LEFT)
    for name, colour in COLOURS.items():
        out.append(f'<rect x="{x:.1f}" y="30" width="12" height="12" fill="{colour}"/>')
        out.append(_text(x + 16, 40, name))
        x += 110
    y = float(TOP)
    for plan in plans:
        out.append(_text(8, y + ROW + 4, plan.deployment.label()))
        for side, who in (("upstream", "vLLM alone"), ("fixed", "plugin")):
            segments = _segments(plan, side)
            out.append(_text(LEFT - 6, y + ROW - 8, who, "end"))
            if segments is None:
                out.append(_text(LEFT + 4, y + ROW - 8, "vLLM cannot build it"))
            else:
                out += _bar(y, scale, segments)
                fits = "fits" if plan.fits(side) else "does not fit"
                total = sum(size for _, size in segments)
                out.append(_text(LEFT + total * scale + 4, y + ROW - 8, fits))
            y += ROW
        y += GAP
    line = LEFT + gpu * scale
    out.append(
        f'<line x1="{line:.1f}" y1="{TOP - 6}" x2="{line:.1f}" y2="{y:.1f}" '
        'stroke="black" stroke-dasharray="4 3"/>'
    )
    out.append(_text(line, y + 14, f"vLLM's share of the GPU: {gpu:.1f} GB", "middle"))
    out.append("</svg>")
    return "\n".join(out) + "\n"
