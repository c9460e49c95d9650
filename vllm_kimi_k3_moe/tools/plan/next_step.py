"""What to ask next when no layout of the advisor's GPUs fits: the fewest
GPUs of that kind that fit, and the formats that fit the GPUs given.

Both answers are the planner's own: a count (or format) is reported as
fitting only where ``Planner.advise`` found a layout that fits. To keep the
search affordable, a count (or format) is skipped, without building
anything, only where it cannot fit: the model's weights spread over all of
its GPUs (a pipeline of one GPU per stage holds every weight once: the
lightest a whole deployment can be) leave less than the reserve on the
heaviest. Each count's answer is kept (``remembered``), so asking again is
instant.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan

# how many GPU counts past the lowest possible one are sized before giving up
COUNTS_TRIED = 12
# the weights over all GPUs can sit slightly below the one-GPU-per-stage
# pipeline's sum (per-stage buffers): a count is skipped only when it misses
# by more than this share
MARGIN = 0.05

Advise = Callable[[int, str, str], tuple[list[DeploymentPlan], list[str]]]
Plan = Callable[[Deployment], DeploymentPlan]


@dataclass(frozen=True)
class NextStep:
    """The fewest GPUs that fit (None: none within the counts tried, the
    last of which is ``tried_up_to``), the fewest on whole nodes, and the
    formats that fit the GPUs asked (name, backend)."""

    fewest: DeploymentPlan | None
    on_whole_nodes: DeploymentPlan | None
    tried_up_to: int
    formats: tuple[tuple[str, str], ...]
    formats_tried: tuple[str, ...]


def fitting(plans: Sequence[DeploymentPlan]) -> list[DeploymentPlan]:
    return [p for p in plans if p.fits("fixed")]


def whole_model_bytes(plans: Sequence[DeploymentPlan]) -> int | None:
    """Every weight once: the summed stages of a layout of one GPU per
    pipeline stage (TP1, DP1), where there is one among ``plans``."""
    for p in plans:
        d = p.deployment
        if d.tp_size == 1 and d.dp_size == 1 and d.dcp_size == 1:
            return sum(stage.fixed.total_bytes for stage in p.stages)
    return None


def cannot_fit(plans: Sequence[DeploymentPlan], whole: int | None, gpus: int) -> bool:
    """Whether no layout of ``gpus`` GPUs can hold ``whole`` bytes of weights
    with the reserve beside them on the heaviest GPU."""
    if whole is None or not plans or plans[0].budget is None:
        return False
    budget = plans[0].budget
    room = budget.requested_bytes - budget.reserve_bytes
    return whole * (1 - MARGIN) / gpus > room


def next_step(
    plans: Sequence[DeploymentPlan],
    gpus: int,
    gpus_per_node: int,
    quantization: str,
    backend: str,
    advise: Advise,
    plan: Plan,
    other_formats: bool,
) -> NextStep:
    """Where none of ``plans`` (every layout of ``gpus`` GPUs) fits: search
    the counts above ``gpus`` (``advise``), and, with ``other_formats``,
    the other formats on ``gpus`` GPUs (each on ``backend`` where it has it,
    else its first)."""
    whole = whole_model_bytes(plans)
    lowest = gpus + 1
    if whole is not None and plans and plans[0].budget is not None:
        budget = plans[0].budget
        room = budget.requested_bytes - budget.reserve_bytes
        lowest = max(lowest, math.ceil(whole * (1 - MARGIN) / room))
    fewest = on_whole_nodes = None
    count = lowest
    for count in range(lowest, lowest + COUNTS_TRIED):
        found = fitting(advise(count, quantization, backend)[0])
        if found and fewest is None:
            fewest = found[0]
        if found and count % gpus_per_node == 0:
            on_whole_nodes = found[0]
            break
    if fewest is not None and on_whole_nodes is None:
        # the next count of whole nodes, which holds at least the fewest
        nodes = math.ceil(fewest.deployment.gpus / gpus_per_node) * gpus_per_node
        found = fitting(advise(nodes, quantization, backend)[0])
        on_whole_nodes = found[0] if found else None
    formats, tried = [], []
    for fmt in FORMATS if other_formats else ():
        if fmt.name == quantization:
            continue
        kernel = backend if backend in fmt.moe_backends else fmt.moe_backends[0]
        tried.append(fmt.name)
        pipeline = Deployment(1, pp_size=gpus, backend=kernel, quantization=fmt.name)
        try:
            lightest = [plan(pipeline)]
        except ValueError:  # the format's kernel refuses TP1: no bound
            lightest = []
        if cannot_fit(lightest, whole_model_bytes(lightest), gpus):
            continue
        if fitting(advise(gpus, fmt.name, kernel)[0]):
            formats.append((fmt.name, kernel))
    return NextStep(fewest, on_whole_nodes, count, tuple(formats), tuple(tried))


def next_step_lines(
    step: NextStep, gpus: int, gpu_title: str, command: Callable[..., str]
) -> list[str]:
    """The advisor's last words where nothing fits: each next step as the
    ``plan`` command that shows it (``command(gpus, quantization=,
    moe_backend=)``)."""
    lines = ["", f"No layout of {gpus} x {gpu_title} fits (why: the note column)."]
    if step.fewest is None:
        lines.append(f"None fits on up to {step.tried_up_to} of these GPUs either.")
    else:
        best = step.fewest.deployment
        lines += [
            f"Fewest of these GPUs that fit: {best.gpus} ({best.label()} holds the "
            "most KV cache):",
            f"    {command(best.gpus)}",
        ]
        whole = step.on_whole_nodes
        if whole is not None and whole.deployment.gpus != best.gpus:
            lines += [
                f"On whole nodes: {whole.deployment.gpus} "
                f"({whole.deployment.label()}):",
                f"    {command(whole.deployment.gpus)}",
            ]
    if step.formats:
        lines.append(f"Other formats that fit {gpus} x {gpu_title}:")
        lines += [
            f"    {command(gpus, quantization=name, moe_backend=kernel)}"
            for name, kernel in step.formats
        ]
    elif step.formats_tried:
        lines += textwrap.wrap(
            f"No other format fits {gpus} x {gpu_title} either "
            f"({', '.join(step.formats_tried)}, each sized as above).",
            88,
        )
    return lines
