"""What ``vllm-kimi-k3-moe check`` prints for a ``PreflightReport``: one screen.

The cause first when there is one (expert tensors in another format, or
under other names, than ``config.json`` says), then the summary of the
checkpoint and of each GPU's share, then the problems grouped: counts per
kind and per shard, a few of each kind and how many more (``--all``: every
one), and the verdict last. However broken the checkpoint, that is about 40
lines.
"""

from __future__ import annotations

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats.layouts import PROJECTIONS
from vllm_kimi_k3_moe.tools.check.layout import KimiK3Layout, layer_ranges
from vllm_kimi_k3_moe.tools.check.preflight import PreflightReport
from vllm_kimi_k3_moe.tools.check.problems import Problem, ProblemLog
from vllm_kimi_k3_moe.tools.check.sharding import (
    GpuShare,
    ShareRun,
    StageShare,
    row_runs,
)
from vllm_kimi_k3_moe.tools.plan.planner import MoeMemoryPlan

EXAMPLES = 3  # problems shown per kind without --all
SHARDS_SHOWN = 3  # shards named in the per-shard summary
INDENT = " " * 12  # continuation lines, under the values


def _bytes(count: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} bytes"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def headline(report: PreflightReport) -> list[str]:
    """The cause, before anything else, when one explains the problems."""
    return [f"MISMATCH    {report.mismatch}"] if report.mismatch else []


def summary(report: PreflightReport, online: str | None = None) -> list[str]:
    """``online``: the serve line's ``--quantization``, a method that
    quantizes the BF16 experts while vLLM loads them."""
    layout = report.layout
    main, mtp = layout.main_layers, layout.mtp_layers
    suffixes = layout.format.tensors.suffixes
    per_expert = len(PROJECTIONS) * len(suffixes)
    loads = (
        f"loads its experts with {layout.format.loads_as}"
        if online is None
        else f"quantizes its experts while loading them (--quantization {online})"
    )
    return [
        f"checkpoint  {report.directory}",
        f"format      {layout.format.name}; vLLM {loads}",
        f"shards      {report.headers_read} of {report.shards} headers read (no "
        f"tensor data), {_bytes(report.total_bytes)} referenced, "
        f"{_bytes(report.expert_bytes)} of it routed experts",
        f"layers      {len(main)} MoE layers ({layer_ranges(main)})"
        + (f" + {len(mtp)} MTP ({layer_ranges(mtp)})" if mtp else ""),
        f"experts     {layout.num_experts} per layer x {per_expert} tensors "
        f"(w1, w3, w2 x {', '.join(suffixes)}): "
        f"{report.expert_tensors_expected} expected, "
        f"{report.expert_tensors_found} found and checked",
        *_adapters(report),
        *per_gpu(report),
    ]


def _adapters(report: PreflightReport) -> list[str]:
    """The latent adapters' line: how they are stored, and the count."""
    layout = report.layout
    contracts = layout.adapter_contracts()
    if not contracts:
        return []
    suffixes = sorted({key.split(".", 1)[1] for key, _ in contracts})
    how = (
        f"quantized as the experts ({', '.join(suffixes)})"
        if layout.adapters_quantized
        else f"BF16, left unquantized by {layout.declared_in}"
    )
    return [
        f"adapters    routed_expert_down_proj and up_proj per layer, {how}: "
        f"{report.adapter_tensors_expected} expected, "
        f"{report.adapter_tensors_found} found and checked"
    ]


def per_gpu(report: PreflightReport) -> list[str]:
    """What each GPU loads; with pipeline stages, each stage's GPUs (its
    layers, then the same split of each of its MoE layers); with DCP, that
    it changes none of it."""
    topology = report.parallelism
    head = f"per GPU     {topology.label('sentence')}"
    if topology.pp_size == 1:
        lines = _split(head, report.layout, report.shares, topology.expert_parallel)
    else:
        lines = [
            f"{head}: each stage's {topology.moe_group} GPUs load its MoE "
            "layers alone (GPU r: the r-th of them)"
        ]
        for stage in report.stages:
            start, end = stage.layers
            layers = (
                f"layers {start}-{end - 1}" if end - start > 1 else f"layer {start}"
            )
            stage_head = f"{f'stage {stage.stage}':<12}decoder {layers}"
            if not stage.moe_layers:
                lines.append(f"{stage_head}: no MoE layer")
                continue
            lines += _split(
                f"{stage_head} (MoE layers {layer_ranges(stage.moe_layers)})",
                report.layout,
                stage.shares,
                topology.expert_parallel,
            )
        if report.layout.mtp_layers:
            lines.append(
                f"{INDENT}MTP draft layers "
                f"{layer_ranges(report.layout.mtp_layers)}: in no stage above"
            )
    if topology.dcp_size > 1:
        lines.append(
            f"DCP         {topology.dcp_size} GPUs of each TP group share the "
            "MLA KV cache; no weight moves: each GPU loads the same as without it"
        )
    return lines


def _expert_split(head: str, layout: KimiK3Layout, shares: list[GpuShare]) -> list[str]:
    """Whole experts per GPU: one line where they split evenly; else a line
    for the first GPUs, one expert heavier, and one for the rest, as vLLM
    places them (``Topology.expert_ranges``)."""
    counts = [share.experts[1] - share.experts[0] for share in shares]
    n, gpus = counts[0], len(shares)
    rows = f"all {layout.intermediate} intermediate rows"
    data = "of routed-expert checkpoint data"
    if len(set(counts)) == 1:
        return [
            f"{head}: {n} of {layout.num_experts} experts (GPU r: "
            f"experts {n}r to {n}r+{n - 1}), {rows}; "
            f"{_bytes(shares[0].expert_bytes)} {data}"
        ]
    heavy = counts.count(n)
    light = shares[heavy]
    each = " each" if gpus - heavy > 1 else ""
    return [
        f"{head}: {layout.num_experts} experts over {gpus} GPUs, as vLLM "
        f"places them (the first {heavy} one more), {rows}:",
        f"{INDENT}{_gpus(ShareRun(0, heavy - 1, 0, n, 0))}: "
        f"{_plural(n, 'expert')} each (GPU r: experts {n}r to {n}r+{n - 1}); "
        f"{_bytes(shares[0].expert_bytes)} {data} each",
        f"{INDENT}{_gpus(ShareRun(heavy, gpus - 1, 0, n - 1, 0))}: "
        f"{_plural(n - 1, 'expert')}{each}, the rest in order from expert "
        f"{light.experts[0]}; {_bytes(light.expert_bytes)} {data}{each}",
    ]


def _split(
    head: str, layout: KimiK3Layout, shares: list[GpuShare], expert_parallel: bool
) -> list[str]:
    """What each GPU of one MoE group loads: one line for an even split, a
    line per run of GPUs with the same rows where the format's split is not
    even."""
    if expert_parallel:
        return _expert_split(head, layout, shares)
    runs = row_runs(shares)
    if len(runs) == 1:
        run = runs[0]
        return [
            f"{head}: all {layout.num_experts} experts, "
            f"{_rows(run, layout.intermediate)}; {_bytes(run.expert_bytes)} of "
            "routed-expert checkpoint data"
        ]
    rule = layout.format.row_split_rule
    caveat = []
    if layout.format.format.partition_rule.kernel_may_allocate_more:
        caveat = [
            f"{INDENT}(as whole groups need them; a kernel that allocates more "
            "rows per GPU, as",
            f"{INDENT}MXFP4 on Marlin does (128), gives each GPU that many: "
            "--moe-backend NAME)",
        ]
    return [
        f"{head}: all {layout.num_experts} experts, {rule} of each:",
        *(
            f"{INDENT}{_gpus(run)}: "
            + (
                "none of the experts' rows"
                if run.count == 0
                else f"{_rows(run, layout.intermediate)}; "
                f"{_bytes(run.expert_bytes)} of routed-expert checkpoint data"
                + (" each" if run.last > run.first else "")
            )
            for run in runs
        ),
        *caveat,
    ]


def _gpus(run: ShareRun) -> str:
    if run.first == run.last:
        return f"GPU {run.first}"
    return f"GPUs {run.first}-{run.last}"


def _rows(run: ShareRun, intermediate: int) -> str:
    """ "96 of 3072 intermediate rows each (GPU r: rows 96r to 96r+95)"."""
    n = run.count
    if run.first == run.last:
        return f"rows {run.start} to {run.start + n - 1} ({n} of {intermediate})"
    if run.start == n * run.first:
        where = f"rows {n}r to {n}r+{n - 1}"
    else:
        where = f"rows {run.start}+{n}(r-{run.first}) onwards, {n} of them"
    return f"{n} of {intermediate} intermediate rows each (GPU r: {where})"


def routed_bytes_by_stage(
    plan: MoeMemoryPlan, stages: list[StageShare]
) -> list[tuple[int, int | None]]:
    """(with the plugin, vLLM alone's or None) routed-expert bytes one GPU of
    each pipeline stage allocates: its stage's main-model MoE layers only;
    without pipeline stages, every one of them."""
    counts = [len(s.moe_layers) for s in stages] if stages else [plan.moe_layers]
    upstream = plan.upstream
    return [
        (plan.fixed.routed_bytes * n, upstream and upstream.routed_bytes * n)
        for n in counts
    ]


def allocation(plan: MoeMemoryPlan, stages: list[StageShare]) -> list[str]:
    """vLLM's allocation for the deployment, upstream and with the plugin:
    what one GPU holds, per pipeline stage where there are stages."""
    upstream = plan.upstream
    rows = (
        f"{plan.fixed.intermediate_per_rank} intermediate rows per expert with "
        "this plugin "
        + (
            f"(upstream {upstream.intermediate_per_rank})"
            if upstream is not None
            else f"({VLLM} alone cannot build it: {plan.upstream_refusal})"
        )
    )
    head = f"allocated   on {plan.deployment.backend}, by {VLLM}'s own layer: {rows}"
    by_stage = routed_bytes_by_stage(plan, stages)
    if not stages:
        ((fixed, alone),) = by_stage
        return [
            f"{head}; routed experts {_bytes(fixed)} per GPU over the "
            f"{plan.moe_layers} main-model MoE layers"
            + ("" if alone is None else f" (upstream {_bytes(alone)})")
        ]
    lines = [f"{head}; routed experts per GPU, its stage's MoE layers only:"]
    for stage, (fixed, alone) in zip(stages, by_stage, strict=True):
        lines.append(
            f"{INDENT}stage {stage.stage}: {_bytes(fixed)} per GPU over its "
            f"{_plural(len(stage.moe_layers), 'MoE layer')}"
            + ("" if alone is None else f" (upstream {_bytes(alone)})")
        )
    return lines


def problem_lines(problems: ProblemLog, show_all: bool = False) -> list[str]:
    """Counts per kind and per shard, then each kind's first problems and
    how many more (every one with ``show_all``)."""
    if not problems:
        return []
    counts = problems.counts()
    lines = [
        f"problems    {len(problems)}: "
        + ", ".join(f"{n} {kind}" for kind, n in counts.items())
    ]
    shards = problems.shards_by_count()
    shown = shards[: _shown(len(shards), SHARDS_SHOWN, show_all)]
    for index, (shard, kinds) in enumerate(shown):
        label = "by shard    " if index == 0 else INDENT
        lines.append(f"{label}{shard}: {_shard_counts(kinds)}")
    if len(shards) > len(shown):
        more = _plural(len(shards) - len(shown), "more shard")
        lines.append(f"{INDENT}and {more} with problems")
    for kind, found in problems.by_kind.items():
        lines += _examples(kind, found, show_all)
    return lines


def _shard_counts(kinds: dict[str, int]) -> str:
    return ", ".join(
        "unreadable, incomplete or missing" if kind == "shard" else f"{n} {kind}"
        for kind, n in kinds.items()
    )


def _shown(count: int, limit: int, show_all: bool) -> int:
    """How many of ``count`` to list: all if asked, or if only one more
    than ``limit`` (it takes the line that would say "and 1 more")."""
    return count if show_all or count <= limit + 1 else limit


def _examples(kind: str, found: list[Problem], show_all: bool) -> list[str]:
    limit = _shown(len(found), EXAMPLES, show_all)
    lines = [f"  {problem}" for problem in found[:limit]]
    if len(found) > limit:
        lines.append(
            f"  ... and {len(found) - limit} more {kind} problems (--all lists "
            "every one)"
        )
    return lines


def verdict(report: PreflightReport) -> list[str]:
    problems = report.problems
    if not problems:
        return [
            "OK          every routed-expert tensor is present once, with its "
            "format's dtype and shape, and vLLM builds this topology"
        ]
    fix = report.fix or (
        f"make {report.layout.declared_in} declare the format the expert tensors "
        "are in (first line)"
        if report.mismatch
        else "fix the checkpoint"
    )
    return [
        f"FAILED      {_plural(len(problems), 'problem')}: {fix} before launching vLLM"
    ]
