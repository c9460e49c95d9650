"""What ``selftest`` prints: one screen, or one JSON object.

The first line says where it ran and what that means: on a GPU, the kernel
vLLM selected there, timed; on a CPU, vLLM's reference kernel, untimed
(and narrower experts, unless they come from a checkpoint). Then the
layout, the experts, the kernel, each distinct rank partition, vLLM
alone's, the error at each batch size, the times side by side (GPU), and
the verdict.
"""

from __future__ import annotations

import json
import math
from typing import Any

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import format_named
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.selftest.reference import BATCH_SIZES
from vllm_kimi_k3_moe.tools.selftest.run import SelftestResult
from vllm_kimi_k3_moe.tools.selftest.timing import REPEATS, ExpertsTime

INDENT = " " * 12


def _first_line(result: SelftestResult) -> str:
    if result.timed:
        return (
            f"selftest on {result.device}, {VLLM}: the kernel vLLM selects here, timed"
        )
    width = KIMI_K3_MOE_FIELDS["routed_expert_hidden_size"]
    narrower = (
        f", {result.shape.width} wide (not {width})"
        if result.checkpoint is None and result.shape.width != width
        else ""
    )
    if result.interpreted:
        return (
            "selftest on CPU, no CUDA device: the GPU's own Triton kernel, "
            f"interpreted (TRITON_INTERPRET=1), runs each rank{narrower}, untimed"
        )
    return (
        "selftest on CPU, no CUDA device: vLLM's CPU reference kernel runs "
        f"each rank{narrower}, untimed"
    )


def _ranks(first: int, last: int) -> str:
    return f"GPU {first}" if first == last else f"GPUs {first}-{last}"


def _partition_lines(result: SelftestResult) -> list[str]:
    """Runs of GPUs with the same partition, each on one line: the rows
    each GPU's built layer allocated, and how many of them hold checkpoint
    rows by the format's split (``CheckpointFormat.rank_rows``, what
    ``check`` prints; the tests hold it to vLLM's loader)."""
    rows = []
    for index, part in enumerate(result.partitions):
        if result.rows_loaded:
            start, end = result.rows_loaded[index]
            loaded = f"{end - start} loaded" if end > start else "none loaded: a pad"
        else:
            loaded = "whole experts"
        key = (part.allocated, part.local_experts, loaded)
        if rows and rows[-1][2] == key and rows[-1][1] == index - 1:
            rows[-1][1] = index
        else:
            rows.append([index, index, key])
    lines = []
    for first, last, (allocated, experts, loaded) in rows:
        lines.append(
            f"{_ranks(first, last)}: {allocated} rows per expert ({loaded}), "
            f"{experts} experts"
        )
    return lines


def _error_line(errors: dict[int, float]) -> str:
    """The errors at 1, 16 and 128 tokens."""
    return ", ".join(f"{errors[n]:.1e}" for n in BATCH_SIZES if n in errors)


def _us(time: ExpertsTime | None) -> str:
    """A time as the table prints it: the CUDA graph's, the eager one beside."""
    if time is None:
        return "-"
    graph = "not captured" if time.graph is None else f"{time.graph:.1f}"
    return f"{graph} ({time.eager:.1f})"


def _time_lines(result: SelftestResult) -> list[str]:
    if not result.timed:
        return []
    if not result.times:
        return ["time        not measured: the plugin's layout did not run"]
    alone_rows = result.vllm_alone_kept or result.vllm_alone
    alone = f"vLLM alone ({alone_rows} rows)" if alone_rows else "vLLM alone"
    what = (
        "routing included: the kernel routes"
        if result.routes_inside
        else ("routed before")
    )
    header = (
        f"  {'tokens':>6}  {f'plugin ({result.partitions[0].allocated} rows)':>24}"
        f"  {alone:>24}  plugin / vLLM alone"
    )
    lines = [
        f"time        GPU 0's routed experts alone ({what}), us, median of {REPEATS} "
        f"CUDA-graph replays (eager calls)",
        header,
    ]
    not_captured = []
    for tokens in BATCH_SIZES:
        plugin, alone_time = result.times[tokens]
        not_captured += [
            t.not_captured for t in (plugin, alone_time) if t and t.not_captured
        ]
        if alone_time is None:
            failed = "build" if result.vllm_alone is None else "run"
            rest = f"  vLLM alone cannot {failed} this layout"
        else:
            rest = f"{_us(alone_time):>24}  {_ratio(plugin, alone_time):>19}"
        lines.append(f"  {tokens:>6}  {_us(plugin):>24}  {rest}")
    if not_captured:
        lines.append(f"{INDENT}not captured in a CUDA graph: {not_captured[0]}")
    return lines


def _ratio(plugin: ExpertsTime, alone: ExpertsTime) -> str:
    """The graphs' ratio (the eager calls' where either was not captured)."""
    if plugin.graph is not None and alone.graph is not None:
        return f"{plugin.graph / alone.graph:.2f}"
    return f"{plugin.eager / alone.eager:.2f} eager"


def _verdict(result: SelftestResult) -> str:
    gpus = result.case.topology.moe_group
    if result.failure is not None:
        return f"WRONG       {result.failure}"
    if result.ok:
        return (
            f"OK          every GPU's partition runs, and the {gpus} GPUs sum to "
            "the unsharded experts"
        )
    worst = max(result.errors, key=lambda n: result.errors[n] / result.tolerances[n])
    return (
        f"WRONG       the {gpus} GPUs' outputs sum to an error of "
        f"{result.errors[worst]:.2g} at {worst} token{'s' * (worst > 1)}, above the "
        f"{result.tolerances[worst]:.1e} allowed"
    )


def screen(result: SelftestResult) -> str:
    """The report, one screen."""
    case, shape = result.case, result.shape
    fmt = format_named(case.quantization)
    source = (
        f"layer {1} of {result.checkpoint}"
        if result.checkpoint is not None
        else "a synthetic checkpoint"
    )
    lines = [
        _first_line(result),
        f"layout      {case.topology.label()} ({case.topology.moe_group} GPUs per "
        f"MoE layer): {fmt.title} on --moe-backend {case.backend}",
        f"experts     {shape.experts} of {case.text_config['num_experts']} "
        f"(top-{shape.top_k}), {shape.intermediate} rows x {shape.width} wide, "
        f"from {source}",
        f"kernel      {result.kernel or 'none ran'}",
    ]
    partitions = _partition_lines(result)
    for index, line in enumerate(partitions or ["none built"]):
        lines.append(f"{'partition' if index == 0 else '':<12}{line}")
    if result.vllm_alone is not None:
        alone = f"{result.vllm_alone} rows per expert on GPU 0"
        if result.vllm_alone_kept is not None:
            alone += f", {result.vllm_alone_kept} once its kernel pads them"
    elif result.vllm_alone_failure is not None:
        alone = f"cannot build this layout ({result.vllm_alone_failure})"
    else:
        alone = "not built"
    lines.append(f"vLLM alone  {alone}")
    if result.errors:
        tokens = ", ".join(map(str, result.errors))
        lines.append(
            f"error       {_error_line(result.errors)} at {tokens} tokens "
            "(GPUs summed vs unsharded)"
        )
        lines.append(
            f"{INDENT}one GPU with every row: {_error_line(result.unsharded)}; "
            f"allowed 2x, at least {result.floor:.0e}"
        )
    lines += _time_lines(result)
    lines.append(_verdict(result))
    return "\n".join(lines)


def _numbers(values: dict[int, float]) -> dict[str, float | None]:
    """tokens -> value, JSON's way: a NaN is null."""
    return {str(n): v if math.isfinite(v) else None for n, v in values.items()}


def as_dict(result: SelftestResult) -> dict[str, Any]:
    """The report as one JSON object."""
    case = result.case
    return {
        "status": "ok" if result.ok else "wrong",
        "device": result.device,
        "timed": result.timed,
        "interpreted": result.interpreted,
        "vllm": VLLM,
        "layout": {
            "tp": case.topology.tp_size,
            "dp": case.topology.dp_size,
            "ep": case.topology.expert_parallel,
            "gpus": case.topology.moe_group,
        },
        "quantization": case.quantization,
        "moe_backend": case.backend,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "experts": {
            "count": result.shape.experts,
            "top_k": result.shape.top_k,
            "intermediate": result.shape.intermediate,
            "width": result.shape.width,
        },
        "kernel": result.kernel,
        "partitions": [
            {
                "gpu": index,
                "rows": part.allocated,
                "experts": part.local_experts,
                "rows_loaded": (
                    list(result.rows_loaded[index]) if result.rows_loaded else None
                ),
            }
            for index, part in enumerate(result.partitions)
        ],
        "vllm_alone": {
            "rows": result.vllm_alone,
            "rows_kept": result.vllm_alone_kept or result.vllm_alone,
            "error": result.vllm_alone_failure,
        },
        "errors": _numbers(result.errors),
        "unsharded_errors": _numbers(result.unsharded),
        "allowed": _numbers(result.tolerances),
        "times_us": {
            str(n): {
                "plugin": plugin.graph,
                "vllm_alone": alone and alone.graph,
                "plugin_eager": plugin.eager,
                "vllm_alone_eager": alone and alone.eager,
                "not_captured": plugin.not_captured or (alone and alone.not_captured),
            }
            for n, (plugin, alone) in result.times.items()
        }
        or None,
        "timed_with_routing": result.routes_inside if result.times else None,
        "failure": result.failure,
        "verdict": _verdict(result).split(None, 1)[1],
    }


def as_json(result: SelftestResult) -> str:
    return json.dumps(as_dict(result), indent=2)
