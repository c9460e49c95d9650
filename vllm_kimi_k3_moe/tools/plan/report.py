"""Render ``DeploymentPlan`` results: the tables a person reads (one screen,
120 columns; ``--wide`` for every column) and the JSON document."""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Callable, Collection, Sequence
from typing import Any

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import (
    ACTIVATIONS_GIB,
    CONTEXT_GIB,
    GIB,
)
from vllm_kimi_k3_moe.tools.deployment.kv_budget import KvBudget
from vllm_kimi_k3_moe.tools.deployment.topology import Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank.kv_cache import KvCacheShape
from vllm_kimi_k3_moe.tools.plan.public_layouts import PublicLayout
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan

GB = 10**9
SERVE_COMMANDS_SHOWN = 3  # the advisor's text; --json has every one


CANNOT_BUILD = "-"  # vLLM alone's cell where it cannot build the layout


def _gb(num_bytes: int | None) -> str:
    return CANNOT_BUILD if num_bytes is None else f"{num_bytes / GB:.1f}"


def _gb_per_layer(num_bytes: int | None) -> str:
    return CANNOT_BUILD if num_bytes is None else f"{num_bytes / GB:.3f}"


def _total(allocation: Any) -> int | None:
    return None if allocation is None else allocation.total_bytes


def _render(
    groups: list[tuple[str, list[str]]], rows: list[list[str]], left_last: bool = False
) -> list[str]:
    """Columns under spanning group labels; first column left, others right
    (the last one left too, with ``left_last``)."""
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
        if left_last:
            padded[-1] = cells[-1].ljust(widths[-1])
        return "  ".join(padded).rstrip()

    return ["  ".join(spans).rstrip(), line(names), *(line(r) for r in rows)]


def wide_table(
    plans: Sequence[DeploymentPlan],
    format_title: str = "",
    gpu: str | None = None,
    memory_given: str | None = None,
) -> str:
    """``--wide``: one row per deployment with every column; per-GPU
    figures, GB = 10^9 bytes (``format_title``: the format's, by default;
    ``gpu``, ``memory_given``: as ``table``'s)."""
    first = plans[0]
    layers = first.moe.moe_layers
    budget, serving = first.budget, first.serving
    groups = [  # the default table's words: vLLM (alone), plugin
        ("", ["layout", "GPUs", "nodes", "experts"]),
        ("rows per GPU", ["logical", "vLLM", "plugin"]),
        ("routed GB per layer", ["vLLM", "plugin", "floor"]),
        (f"routed GB, {layers} layers", ["vLLM", "plugin", "floor"]),
        ("weights GB/GPU", ["vLLM", "plugin"]),
    ]
    if budget is not None:
        groups += [
            ("fits", ["vLLM", "plugin"]),
            ("KV tokens", ["vLLM", "plugin"]),
            ("requests", ["vLLM", "plugin"]),
        ]
    rows = []
    for p in plans:
        moe, totals = p.moe, p.moe.all_moe_layers
        row = [
            p.deployment.label(),
            str(p.deployment.gpus),
            str(p.nodes.nodes),
            str(moe.fixed.local_experts),
            str(moe.logical_intermediate_per_rank),
            str(moe.upstream.intermediate_per_rank) if moe.upstream else CANNOT_BUILD,
            str(moe.fixed.intermediate_per_rank),
            _gb_per_layer(moe.upstream and moe.upstream.routed_bytes),
            _gb_per_layer(moe.fixed.routed_bytes),
            _gb_per_layer(moe.floor_routed_bytes),
            _gb(totals["upstream_routed_bytes"]),
            _gb(totals["fixed_routed_bytes"]),
            _gb(totals["floor_routed_bytes"]),
            _gb(_total(p.upstream)),
            _gb(p.fixed.total_bytes),
        ]
        if budget is not None:
            kv = (p.upstream_kv, p.fixed_kv)
            row += ["yes" if c and c.tokens else "no" for c in kv]
            row += [f"{c.tokens:,}" if c else CANNOT_BUILD for c in kv]
            row += [f"{c.concurrency:.1f}" if c else CANNOT_BUILD for c in kv]
        rows.append(row)

    d = first.deployment
    notes = [
        "experts: routed experts per GPU. rows per GPU: each routed expert's",
        "intermediate rows on a GPU: its logical slice, what vLLM alone allocates",
        f"({VLLM}) and what it allocates with this plugin. floor: the routed",
        "experts at exactly the logical size. weights: every parameter of the",
        "Kimi-K3 model vLLM serves on the heaviest GPU (embeddings, lm_head, MLA",
        "and KDA attention, dense layer, MoE layers, norms, the vision tower).",
    ]
    if budget is not None:
        kv = first.kv_cache
        notes += [
            *_fits_note(
                budget,
                serving,
                "sized by vLLM's own block-pool planner from the built layers' "
                "KV-cache specs.",
                memory_given,
            ),
            *_kv_columns_note(plans),
            f"KV cache ({serving.kv_cache_dtype}): {kv.mla_bytes_per_token:,} bytes "
            f"per token on every GPU ({kv.mla_layers} MLA layers), plus",
            f"the state of {kv.kda_layers} KDA layers per sequence, split by TP.",
            *_rocm_backend_note(plans),
            *_indexer_note(kv),
        ]
    return "\n".join(
        [
            f"Kimi-K3 per GPU on {VLLM}: {format_title or d.format.title} on "
            f"{d.backend}, {layers} MoE layers, GB = 10^9 bytes"
            + _gpu_heading(budget, gpu),
            "",
            *_render(groups, rows),
            "",
            *notes,
            *_dcp_note(plans),
            *_draft_note(plans),
        ]
    )


def _note(plan: DeploymentPlan) -> str:
    """The last column: why it does not fit, or what the plugin changes."""
    if plan.budget is None:
        return ""
    reason = plan.reason()
    if reason is not None:
        return reason
    if plan.moe.upstream_refusal is not None:
        cannot = "run" if plan.moe.upstream is not None else "build"
        return f"{VLLM} alone cannot {cannot} it"
    if plan.plugin_makes_it_fit:
        return "fits with the plugin only"
    return ""


def table(
    plans: Sequence[DeploymentPlan],
    title: str | None = None,
    marked: Collection[Topology] = (),
    format_title: str = "",
    gpu: str | None = None,
    memory_given: str | None = None,
) -> str:
    """The default table: one row per deployment, what a person deciding
    needs (120 columns): the layout (`` *`` after those ``marked``), the
    heaviest GPU's weights as vLLM alone and with the plugin allocate them,
    and, with a GPU size, whether each fits, the KV cache and why not.
    ``gpu``: how the heading names the GPU, once (default: its size in
    GB); the fits note gives its memory in GB, and the option that gave it
    (``memory_given``: ``--gpu-memory-gb 192``), once."""
    first = plans[0]
    budget, serving = first.budget, first.serving
    groups = [
        ("", ["layout", "GPUs", "nodes"]),
        ("weights GB/GPU", ["vLLM", "plugin"]),
    ]
    if budget is not None:
        groups += [
            ("fits", ["vLLM", "plugin"]),
            ("with the plugin", ["KV tokens", "requests"]),
            ("", ["note"]),
        ]
    rows = []
    for p in plans:
        mark = " *" if p.deployment.topology in marked else ""
        row = [
            p.deployment.label() + mark,
            str(p.deployment.gpus),
            str(p.nodes.nodes),
            _gb(_total(p.upstream)),
            _gb(p.fixed.total_bytes),
        ]
        if budget is not None:
            assert p.fixed_kv is not None
            row += ["yes" if p.fits(side) else "no" for side in ("upstream", "fixed")]
            row += [f"{p.fixed_kv.tokens:,}", f"{p.fixed_kv.concurrency:.1f}"]
            row.append(_note(p))
        rows.append(row)
    d = first.deployment
    lines = [
        title
        or (
            f"Kimi-K3 per GPU on {VLLM}: {format_title or d.format.title} on "
            f"{d.backend}, GB = 10^9 bytes" + _gpu_heading(budget, gpu)
        ),
        "",
        *_render(groups, rows, left_last=budget is not None),
        "",
        "weights: every parameter of the Kimi-K3 model vLLM serves (the vision",
        "tower too, unless --language-model-only) on the heaviest GPU (pipeline",
        f"stage), as {VLLM} alone allocates it and with this plugin.",
    ]
    if any(p.moe.upstream_refusal for p in plans):
        lines.append(
            f"{CANNOT_BUILD}: {VLLM} alone cannot build the layout; where it builds "
            "one its kernel cannot run,"
        )
        lines.append("it does not fit (why: --json, upstream_refusal).")
        lines += _refusals(plans)
    if budget is not None:
        kv = first.kv_cache
        lines += _fits_note(
            budget, serving, "sized by vLLM's own planner.", memory_given
        )
        lines.append(
            f"KV cache ({serving.kv_cache_dtype}): {kv.mla_bytes_per_token:,} B "
            "per token on every GPU, plus KDA state per sequence."
        )
        lines += _rocm_backend_note(plans)
        lines += _kv_columns_note(plans)
        lines += _indexer_note(kv)
    return "\n".join(lines + _dcp_note(plans) + _draft_note(plans))


def _refusals(plans: Sequence[DeploymentPlan]) -> list[str]:
    """Why vLLM alone cannot build the layouts it cannot, each reason once
    with the layouts it holds for (a build refused for one reason usually
    refuses many layouts)."""
    by_reason: dict[str, list[str]] = {}
    for p in plans:
        if p.moe.upstream is None and p.moe.upstream_refusal is not None:
            layouts = by_reason.setdefault(p.moe.upstream_refusal, [])
            layouts.append(p.deployment.label())
    lines = []
    for reason, layouts in by_reason.items():
        lines += textwrap.wrap(
            f"{VLLM} alone cannot build {', '.join(layouts)}: {reason}",
            88,
            subsequent_indent="  ",
        )
    return lines


def _kv_columns_note(plans: Sequence[DeploymentPlan]) -> list[str]:
    """What the KV columns are, and why they move with --max-model-len the
    way they do (vLLM's ``get_kv_cache_capacity``: tokens are its maximum
    concurrency times the length)."""
    length = plans[0].serving.max_model_len
    return textwrap.wrap(
        "requests: how many requests of --max-model-len "
        f"({length}) tokens the KV cache holds at once (vLLM's maximum "
        "concurrency); KV tokens: requests x --max-model-len, as vLLM logs its "
        "KV cache size. Each request also holds its KDA state whatever its "
        f"length ({_kda_state(plans)}), so a shorter --max-model-len holds "
        "more requests and fewer "
        "KV tokens; more GPU memory, a lighter layout or an fp8 --kv-cache-dtype "
        "raise both.",
        80,
        break_on_hyphens=False,
    )


def _kda_state(plans: Sequence[DeploymentPlan]) -> str:
    """Each request's KDA state on a GPU of the layouts ``plans`` size, by
    TP size (which splits it; DCP does not), as vLLM's specs give it for a
    GPU holding every layer (pipeline stages share it out)."""
    by_tp: dict[int, int] = {}
    for p in plans:
        by_tp.setdefault(p.deployment.tp_size, p.kv_cache.kda_bytes_per_sequence)
    sizes = ", ".join(
        f"{kda / GB * 1000:.0f} MB at TP{tp}" for tp, kda in sorted(by_tp.items())
    )
    return f"per GPU holding every layer: {sizes}; pipeline stages share it out"


def _gpu_gb(budget: KvBudget) -> float:
    """A GPU's memory in the answer's unit, GB (the options give GiB)."""
    return budget.gpu_memory_gib * 2**30 / GB


def _gpu_heading(budget: KvBudget | None, gpu: str | None) -> str:
    """The heading's words for the GPU, the one place they name it:
    ``gpu``, else its memory in GB; nothing without a GPU size."""
    if budget is None:
        return ""
    return f", {gpu or f'{_gpu_gb(budget):.1f} GB'} GPUs"


def _rocm_backend_note(plans: Sequence[DeploymentPlan]) -> list[str]:
    """On an AMD GPU: the MLA backend whose blocks the KV cache was sized
    with, as vLLM's ROCm selector picked it, and each layout's block size:
    vLLM makes an MLA block at least one KDA layer's state of a request
    (``Platform.update_block_size_for_backend``), which TP splits, so the
    blocks differ by TP size (TP8 twice TP16's)."""
    kv = plans[0].kv_cache
    if kv.rocm_mla_backend is None:
        return []
    blocks = sorted(
        {(p.deployment.tp_size, p.kv_cache.block_size) for p in plans},
        key=lambda pair: pair[0],
    )
    sizes = ", ".join(f"{tokens:,} at TP{tp}" for tp, tokens in blocks)
    return textwrap.wrap(
        f"MLA attention: {kv.rocm_mla_backend}, as vLLM's ROCm selector picks it "
        f"here (its KV-cache blocks, tokens per GPU: {sizes}).",
        80,
        break_on_hyphens=False,
    )


def _indexer_note(kv: KvCacheShape) -> list[str]:
    """What DSA layers add to the KV cache, where the model has them."""
    if not kv.dsa_layers:
        return []
    return [
        f"{kv.dsa_layers} of the MLA layers are DSA layers: their indexers' keys "
        f"add {kv.indexer_bytes_per_token:,} B per token."
    ]


def _draft_note(plans: Sequence[DeploymentPlan]) -> list[str]:
    """What a speculative draft adds, under a table of plans with one."""
    first = plans[0]
    spec = first.speculative_config
    if spec is None:
        return []
    draft = max(p.fixed.components["speculative_draft"] for p in plans)
    kv = first.kv_cache
    model = f" ({spec['model']})" if spec.get("model") else ""
    return [
        f"draft: {spec['method']}{model} in every figure: its weights (up to "
        f"{draft / GB:.2f} GB per GPU, last",
        "pipeline stage) and its layers' KV cache, grouped by vLLM with the "
        f"target's ({kv.padding_layers} padding layers).",
    ]


def _fits_note(
    budget: KvBudget, serving: Serving, rest: str, memory_given: str | None = None
) -> list[str]:
    """What "fits" means on the installed vLLM, in the rows' GB alone (the
    options are in GiB: ``--reserve-gib`` is named, its figure in GB), then
    ``rest``; wrapped to 80 columns. The GPU's memory is as vLLM sees it
    (a preset's), or as an option gave it (``memory_given``: the option and
    its value, said here, once)."""
    share = "--gpu-memory-utilization"
    if not budget.utilization_given:
        share = f"{VLLM}'s default {share}"
    sizing = ""
    if budget.after_warmup:
        sizing = (
            " and sizes the KV cache from the memory it measures after warmup "
            "(its extensible KV cache)"
        )
    if budget.reserve_given:
        made = "as --reserve-gib gave it"
    elif budget.after_warmup:
        made = (
            f"an estimate: CUDA context and NCCL {CONTEXT_GIB * GIB / GB:.1f} GB, "
            f"activations and CUDA graphs {ACTIVATIONS_GIB * GIB / GB:.1f} GB, "
            "which vLLM measures at start-up, and the margin vLLM keeps beside "
            "them; --reserve-gib replaces it"
        )
    else:
        made = "an estimate; --reserve-gib replaces it"
    taken = "all" if budget.utilization == 1 else f"{budget.utilization:g}"
    return textwrap.wrap(
        f"fits: vLLM takes {taken} of each GPU's {_gpu_gb(budget):.1f} GB "
        + (f"(as given: {memory_given}; " if memory_given else "(as vLLM sees it; ")
        + f"{share}: {budget.requested_bytes / GB:.1f} GB){sizing}, less the "
        f"weights and a {budget.reserve_bytes / GB:.1f} GB reserve ({made}); the "
        f"rest is KV cache, {rest} It fits when that holds one request of "
        f"--max-model-len {serving.max_model_len}.",
        80,
        break_on_hyphens=False,  # an option stays on one line
    )


def _dcp_note(plans: Sequence[DeploymentPlan]) -> list[str]:
    """What decode context parallelism changes, under a table with DCP."""
    if all(p.deployment.dcp_size == 1 for p in plans):
        return []
    return [
        "DCP N (--decode-context-parallel-size) changes no weight: each GPU "
        "holds the MLA cache of one",
        "token in N of every request but its KDA state whole, so fewer than "
        "N times the tokens fit.",
    ]


def _wrapped(command: str, width: int = 100, indent: int = 4) -> list[str]:
    """``command`` over lines of at most ``width`` columns, ``indent`` in,
    continued with a backslash as a shell reads it, breaking only before an
    option (always before ``--nnodes``)."""
    groups: list[str] = []
    for word in shlex.split(command):
        if word.startswith("--") or not groups:
            groups.append(shlex.quote(word))
        else:
            groups[-1] += " " + shlex.quote(word)
    lines = [" " * indent + groups[0]]
    for group in groups[1:]:
        # a node's own flags start a line: the nodes' lines differ there alone
        if len(lines[-1]) + 1 + len(group) + 2 > width or group.startswith("--nnodes"):
            lines[-1] += " \\"
            lines.append(" " * (indent + 4) + group)
        else:
            lines[-1] += " " + group
    return lines


def _in_table(plan: DeploymentPlan) -> bool:
    """Whether the advisor's table shows ``plan``: every layout without DCP,
    and with the largest DCP (its TP) where the weights leave memory for a
    KV cache. The DCP sizes between hold a KV cache between those two rows
    (a request's MLA share per GPU shrinks with DCP, nothing else changes);
    DCP does not change weights that do not fit."""
    d, kv = plan.deployment, plan.fixed_kv
    if d.dcp_size == 1:
        return True
    return d.dcp_size == d.tp_size and (kv is None or kv.available_bytes > 0)


def _serve_commands(heading: str, plans: Sequence[DeploymentPlan]) -> list[str]:
    lines = ["", heading]
    for p in plans:
        assert p.advised_command is not None  # only layouts that fit
        lines += [f"  {p.deployment.label()}{_over_nodes(p)}:", *_node_lines(p)]
    return lines


def _over_nodes(plan: DeploymentPlan) -> str:
    nodes = plan.nodes
    if not nodes.multi_node:
        return ""
    return (
        f", {nodes.nodes} nodes of {nodes.gpus_per_node} GPUs, HEAD: node 0's address"
    )


def _node_lines(plan: DeploymentPlan) -> list[str]:
    """Each node's line (nodes 0 and 1 in full: the others differ from node
    1's in their ``--node-rank`` alone; ``--json`` has every one)."""
    commands = plan.serve_commands
    if len(commands) == 1:
        return _wrapped(commands[0])
    lines = ["    node 0:", *_wrapped(commands[0], indent=6)]
    lines += ["    node 1:", *_wrapped(commands[1], indent=6)]
    if len(commands) > 2:
        ranks = ", ".join(map(str, range(2, len(commands))))
        lines.append(f"    nodes {ranks}: as node 1, with --node-rank {ranks}")
    return lines


def serve_commands(plans: Sequence[DeploymentPlan]) -> str:
    """Under the table of the layouts asked for: the ``vllm serve`` command
    of each that fits, or why there is none."""
    if plans[0].budget is None:
        return "\n".join(
            _paragraph(
                "vllm serve commands: given a GPU size (--gpu NAME or "
                "--gpu-memory-gb X), plan prints one for each layout that fits."
            )
        )
    fitting = [p for p in plans if p.advised_command]
    if not fitting:
        return "\nNo layout fits, so no vllm serve command: see the note column."
    return "\n".join(
        _serve_commands(
            "vllm serve (with the plugin installed), each layout that fits:", fitting
        )
    )


def advice(
    plans: Sequence[DeploymentPlan],
    refused: Sequence[str],
    title: str,
    public: Sequence[PublicLayout] = (),
    unmarked: str = "",
    pick: Callable[[Topology], str] | None = None,
    next_step: Sequence[str] = (),
    memory_given: str | None = None,
) -> str:
    """The advisor's answer: the layouts that build, ordered by memory as
    the planner orders them (fitting first, most KV cache first), those run
    in public (``public``) marked (else ``unmarked`` says why none is), then
    the ``vllm serve`` commands of the first few that fit and of the public
    ones that fit, and (``pick``: the plan command that sizes one layout
    alone) how to get any other's; where none fits, ``next_step``'s lines
    (``memory_given``: as ``table``'s)."""
    marked = {layout.topology for layout in public}
    rows = [p for p in plans if _in_table(p)]
    heading = (
        f"{title}\nOrdered by memory alone (GB = 10^9 bytes): layouts that fit "
        "first, most KV cache first (speed is not measured)."
    )
    lines = [table(rows, heading, marked, memory_given=memory_given)]
    if public:
        sources = ", ".join(f"{x.topology.label()} ({x.source})" for x in public)
        lines += _paragraph(
            f"* run in public on these GPUs: {sources}; not a speed ranking. "
            "Each as plan sized it (its defaults) and as its source runs it:"
        )
        by_layout = {p.deployment.topology: p for p in plans}
        for layout in public:
            lines += _public_line(layout, by_layout.get(layout.topology), pick)
    elif unmarked:
        lines += _paragraph(unmarked)
    left_out = len(plans) - len(rows)
    if left_out:
        lines += _paragraph(
            f"Not in the table: {left_out} layouts with DCP between 1 and their "
            "TP (KV cache between their layout's rows without DCP and with DCP "
            "= TP) or whose weights do not fit (DCP changes no weight); --json "
            "lists every one."
        )
    fitting = [p for p in plans if p.advised_command]
    if fitting:
        shown = fitting[:SERVE_COMMANDS_SHOWN]
        lines += _serve_commands(
            "vllm serve (with the plugin installed), most KV cache first:", shown
        )
        beaten = [p for p in fitting[len(shown) :] if p.deployment.topology in marked]
        if beaten:
            lines += _serve_commands("vllm serve, the public layouts (*):", beaten)
        others = [p for p in fitting[len(shown) :] if p not in beaten]
        if others and pick is not None:
            example = others[0].deployment
            lines += [
                "",
                f"{len(others)} more fit (--json: each one's command). Any "
                f"layout's command alone, for example {example.label()}'s:",
                f"    {pick(example.topology)}",
            ]
    else:
        lines += list(next_step) or ["", "No layout fits: see the note column."]
    if refused:
        lines += ["", f"{len(refused)} layouts vLLM refuses to build are left out:"]
        lines += [f"  {line}" for line in refused]
    not_counted = plans[0].not_counted
    if not_counted:
        lines += ["", "Not counted:", *(f"  {item}" for item in not_counted)]
    return "\n".join(lines)


def _public_line(
    layout: PublicLayout,
    plan: DeploymentPlan | None,
    pick: Callable[[Topology], str] | None,
) -> list[str]:
    """A public layout: whether it fits at plan's defaults (why not), the
    flags its source runs it with, and the plan command sizing it so."""
    if plan is None:
        verdict = "not built for this format and kernel"
    elif plan.fits("fixed"):
        verdict = "fits at plan's defaults"
    else:
        verdict = f"does not fit at plan's defaults ({plan.reason()})"
    label = layout.topology.label()
    said = f"{label}: {verdict}; " + (
        f"{layout.source} runs it with {layout.flags}"
        if layout.flags
        else "its source states no memory flags"
    )
    lines = textwrap.wrap(said, 88, initial_indent="  ", subsequent_indent="    ")
    if layout.flags and pick is not None:
        lines.append(f"    sized so: {pick(layout.topology)} {layout.flags}")
    return lines


def _paragraph(text: str, width: int = 88) -> list[str]:
    """``text`` wrapped to ``width`` columns, after a blank line."""
    return ["", *textwrap.wrap(text, width)]


def as_json(plans: Sequence[DeploymentPlan], planned_for: dict[str, Any]) -> str:
    """Every layout's figures; each says the GPU it was planned for first
    (``gpus.planned_for``), as the tables' headings do."""
    return json.dumps(
        [{"planned_for": planned_for, **p.to_dict()} for p in plans], indent=2
    )
