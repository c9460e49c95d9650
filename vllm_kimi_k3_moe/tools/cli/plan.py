"""``vllm-kimi-k3-moe plan``: does Kimi-K3 fit, how, and with how much KV cache.

Two modes. With ``--gpus N`` (and a GPU: ``--gpu NAME`` or its memory,
``--gpu-memory-gb X``) the advisor lists every layout of exactly N GPUs
vLLM builds (DCP sizes included), fitting first and most KV cache first,
the public ones marked, with the ``vllm serve`` commands of the first few
and of the public ones, and the ``plan`` command (the other mode) that
prints any other layout's. With ``--tp`` (default 8 16 32, and
``--pp``/``--dp``/``--ep``/``--dcp``) one row per tensor-parallel size and,
given a GPU size, the ``vllm serve`` command of each layout that fits: plan
prints a command only where it says the layout fits. Every input error ends
the command before vLLM's model is imported (the slow part), in one line
with exit status 2.

This file parses the arguments and prints; what plan was asked is validated
in ``tools.plan.asked``, answered in ``tools.plan.answers`` (kept, or worked
out by the ``Planner``), and rendered by ``tools.plan.report``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_kimi_k3_moe.compat import VLLM, builds_dsa_layers
from vllm_kimi_k3_moe.tools.cli.common import (
    CONFIG_JSON,
    PROG,
    backends_by_format,
    config_file,
    fail,
    fraction,
    no_background_kernel_builds,
    positive_float,
    positive_int,
)
from vllm_kimi_k3_moe.tools.cli.vllm_flags import (
    add_context_parallel,
    add_dp_and_ep,
    add_format_and_backend,
    add_vllm_flag,
    add_vllm_flags,
)
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import (
    ACTIVATIONS_GIB,
    CONTEXT_GIB,
    BudgetError,
)
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    ALL_GPU_PRESETS,
    AMD_MOE_BACKENDS,
    AMD_PRESETS,
    GPU_ARCHS,
    XPU,
    XPU_MOE_BACKENDS,
    XPU_PRESETS,
    gpu_preset,
    in_gb,
    planned_for,
)
from vllm_kimi_k3_moe.tools.deployment.nodes import DEFAULT_GPUS_PER_NODE
from vllm_kimi_k3_moe.tools.deployment.topology import (
    DeploymentError,
    Topology,
)
from vllm_kimi_k3_moe.tools.meta_rank.kernel_gpus import KernelOnGpu
from vllm_kimi_k3_moe.tools.plan.answers import Answers
from vllm_kimi_k3_moe.tools.plan.asked import (
    INPUT_ERRORS,
    PlanInput,
    gpu_label,
    memory_given,
    plan_input,
)
from vllm_kimi_k3_moe.tools.plan.next_step import fitting, next_step, next_step_lines
from vllm_kimi_k3_moe.tools.plan.online_notes import note_online
from vllm_kimi_k3_moe.tools.plan.planner import PlanError
from vllm_kimi_k3_moe.tools.plan.plot import memory_svg
from vllm_kimi_k3_moe.tools.plan.public_layouts import public_layouts
from vllm_kimi_k3_moe.tools.plan.report import (
    advice,
    as_json,
    serve_commands,
    table,
    wide_table,
)
from vllm_kimi_k3_moe.tools.plan.serve_command import DEFAULT_MODEL
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _gpus() -> str:
    return ", ".join(
        f"{p.name} ({in_gb(p.memory_gib)})" for p in ALL_GPU_PRESETS.values()
    )


def _amd_backends() -> str:
    return "; ".join(
        f"{q}: {', '.join(b)} ({', '.join(XPU_MOE_BACKENDS[q])} on "
        f"{', '.join(XPU_PRESETS)})"
        for q, b in AMD_MOE_BACKENDS.items()
    )


def add_command(commands: Subcommands) -> None:
    plan = commands.add_parser(
        "plan",
        help="which vLLM layouts serve Kimi-K3 on your GPUs, with how much KV "
        "cache, and the vllm serve command for each",
        description=(
            "Answer before any GPU is involved whether Kimi-K3 fits, and how: "
            f"build {VLLM}'s Kimi-K3 model (vision tower and language model) "
            "for rank 0 of each layout "
            "on the meta device (no GPU, no weights), as vLLM alone builds it "
            "and with this plugin, and report what the heaviest GPU holds; "
            "with a GPU size, also whether vLLM starts and how much KV cache "
            "it then has, from vLLM's own KV-cache planner. "
            "Advisor: --gpus N with --gpu NAME (or --gpu-memory-gb X) lists "
            "every tensor x pipeline x data-parallel layout of exactly N GPUs, "
            "with and without expert parallelism, with every decode-context-"
            "parallel size, that vLLM builds for the format and kernel, "
            "ordered by memory alone (fitting first, most KV cache first; "
            "speed is not measured), marks the layouts public deployments run "
            "on that GPU, prints the vllm serve commands of the first few "
            "and of those, and the plan command that gives any other's. "
            "Otherwise one row per --tp size (default 8 16 32), and, with a GPU "
            "size, the vllm serve command of each that fits (--json: the same, "
            "null where a layout does not fit)."
        ),
        epilog=(
            f"GPUs (--gpu): {_gpus()}: the memory a CUDA process sees (HIP's "
            "on AMD), in GB = 10^9 bytes as the answers give it. "
            f"MoE backends per format (--moe-backend): {backends_by_format()}; "
            f"on an AMD or Intel GPU ({', '.join(AMD_PRESETS + XPU_PRESETS)}), "
            "where plan builds "
            "vLLM's AMD Kimi-K3 MoE: "
            f"{_amd_backends()} (default: what vLLM selects there with "
            "--moe-backend auto). "
            "Exit status: 0 printed, 2 unusable input (one line on stderr)."
        ),
    )
    plan.add_argument(
        "--gpus",
        type=positive_int,
        metavar="N",
        help="advisor: every layout of exactly N GPUs (needs --gpu or "
        "--gpu-memory-gb; not with --tp/--pp/--dp/--ep/--dcp)",
    )
    plan.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"the GPU, for its memory: {', '.join(ALL_GPU_PRESETS)}",
    )
    plan.add_argument(
        "--gpu-memory-gb",
        type=positive_float,
        metavar="X",
        help="memory of one GPU in GB (10^9 bytes, the answers' unit), for any "
        "other GPU: as a datasheet prints it, or as CUDA (HIP) reports it "
        "(torch.cuda.mem_get_info()[1] / 1e9; vLLM sizes from that figure, "
        "which a datasheet's rounds); NVIDIA unless --gpu-arch names an AMD one",
    )
    plan.add_argument(
        "--gpu-memory-gib",
        type=positive_float,
        metavar="X",
        help="the same in GiB (2^30 bytes), as nvidia-smi's MiB / 1024",
    )
    plan.add_argument(
        "--gpu-arch",
        type=str.lower,
        choices=GPU_ARCHS,
        help="the architecture of the AMD GPU --gpu-memory-gb gives (gfx942: "
        "CDNA3, MI300X-class; gfx950: CDNA4, MI350X-class): plan builds "
        "vLLM's AMD Kimi-K3 model for it",
    )
    plan.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=DEFAULT_GPUS_PER_NODE,
        metavar="N",
        help="GPUs per node (default: "
        f"{DEFAULT_GPUS_PER_NODE}): each layout says how many nodes it takes, "
        "and a layout over several nodes gets one vllm serve line per node "
        "(vLLM's multiprocessing launch: --nnodes, --node-rank, --master-addr "
        "HEAD, where HEAD is node 0's address, and --headless on the others)",
    )
    add_vllm_flag(
        plan,
        "--tensor-parallel-size",
        "tensor-parallel sizes, one row each (default: 8 16 32)",
        dest="tp_sizes",
        nargs="+",
    )
    add_vllm_flag(
        plan,
        "--pipeline-parallel-size",
        "pipeline-parallel size: each stage sized from vLLM's layer split (default: 1)",
    )
    add_dp_and_ep(plan)
    add_context_parallel(plan)
    add_format_and_backend(plan, online=True)
    add_vllm_flags(
        plan,
        "--quantization-config",
        "--kv-cache-dtype",
        "--max-model-len",
        "--gpu-memory-utilization",
    )
    plan.add_argument(
        "--reserve-gib",
        type=fraction,
        metavar="N",
        help="GiB per GPU of vLLM's share that neither the weights nor the KV "
        "cache get: what vLLM measures at start-up (activations, CUDA graphs, "
        "communication workspaces; where vLLM sizes the KV cache after warmup "
        "also the CUDA context, NCCL's buffers and vLLM's margin). Default: an "
        f"estimate made of {ACTIVATIONS_GIB:g} GiB of activations and "
        f"{CONTEXT_GIB:g} GiB of CUDA context and NCCL, which plan's notes "
        "give; from a start-up log: GPU GiB x utilization - weights - KV "
        "cache. Needs a GPU size",
    )
    add_vllm_flags(plan, "--speculative-config", "--language-model-only")
    plan.add_argument(
        "--config",
        type=config_file,
        metavar="PATH",
        help="a Hugging Face config.json (or a directory holding one) with "
        "Kimi-K3's whole text config "
        "(may be nested under text_config); default: Kimi-K3's published "
        "text_config (hidden 7168, 93 layers: 24 MLA + 69 KDA, 92 MoE with "
        "896 experts of 3072, latent 3584, vocab 163840)",
    )
    plan.add_argument(
        "--model",
        metavar="PATH_OR_ID",
        help="the checkpoint the serve commands name: a local directory or a "
        "Hugging Face id (default: the directory whose config.json --config "
        f"read, else {DEFAULT_MODEL}, the release)",
    )
    plan.add_argument(
        "--wide",
        action="store_true",
        help="every column (the MoE layer's partition and bytes per layer)",
    )
    plan.add_argument(
        "--json", action="store_true", help="print JSON instead of the table"
    )
    plan.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.svg",
        help="also write one GPU's memory in each layout (weights, reserve, KV "
        "cache), vLLM alone against the plugin, as an SVG figure (needs a GPU "
        "size: --gpu NAME or --gpu-memory-gb X)",
    )
    plan.set_defaults(run=run)


def served_model(model: str | None, config: Path | None) -> str:
    """The checkpoint the serve commands name: ``--model``; else the
    directory of the ``config.json`` that ``--config`` read (whose model
    plan sized); else the release."""
    if model is not None:
        return model
    if config is not None and config.name == CONFIG_JSON:
        return str(config.parent)
    return DEFAULT_MODEL


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def plot_title(asked: PlanInput) -> str:
    """The figure's title: the table's heading, in its words."""
    gpu = f"{asked.gpu_title} GPUs" if asked.gpu_title else "GPUs"
    return (
        f"Kimi-K3, one GPU's memory on {VLLM}: {asked.quantization_title} on "
        f"{asked.backend}, {gpu}, GB = 10^9 bytes"
    )


def _plot(path: Path, plans: list[DeploymentPlan], asked: PlanInput) -> None:
    try:
        figure = memory_svg(plans, plot_title(asked))
        path.write_text(figure)
    except (ValueError, OSError) as error:
        fail("plan", f"--plot {path}: {error}")
    _say(f"plan: wrote {path} (one GPU's memory per layout, vLLM alone and plugin)")


def _plan_input(args: argparse.Namespace) -> PlanInput:
    """Every input error ends the command here, in one line, before vLLM's
    model is imported."""
    try:
        return plan_input(args, _say)
    except INPUT_ERRORS as error:
        fail("plan", str(error))


def run(args: argparse.Namespace) -> int:
    no_background_kernel_builds()  # plan runs vLLM on the meta device only
    asked = _plan_input(args)
    if args.plot is not None and asked.budget is None:
        fail(
            "plan",
            "--plot draws a GPU's memory: give its size, --gpu NAME or "
            "--gpu-memory-gb X",
        )
    answers = Answers(asked, served_model(args.model, args.config), args.gpus_per_node)
    step: list[str] = []
    try:
        kernel = answers.kernel_of_the_asked(
            gpu_label(args) if asked.amd_arch is not None else args.gpu
        )
        if args.gpus is not None:
            plans, refused = answers.advise(args.gpus)
            # the advisor's table ends with it; --json and --wide print the
            # layouts alone (sizing it was more than half of such a command)
            if not fitting(plans) and not (args.json or args.wide):
                step = _next_step(args, asked, answers, plans)
        else:
            plans, refused = answers.plan(asked.deployments), []
    except (DeploymentError, PlanError, BudgetError) as error:
        fail("plan", str(error))
    finally:
        answers.close()
    answers.note_if_kept()
    if args.plot is not None:
        _plot(args.plot, plans, asked)
    _note_dsa_config_unread(asked.text_config)
    _note_kernel_not_verified(kernel, args.gpu)
    _note_attention_borrowed(asked.amd_arch, gpu_label(args), plans)
    note_online(asked.online, plans, _say)
    # the option that gave the GPU's memory: the fits note says it once
    given = None if asked.memory_given is None else shlex.join(asked.memory_given.words)
    if args.json:
        gpu = None if args.gpu is None else gpu_preset(args.gpu).name
        print(as_json(plans, planned_for(gpu, asked.amd_arch, asked.capability)))
    elif args.wide:
        print(wide_table(plans, asked.quantization_title, asked.gpu_title, given))
        print(serve_commands(plans))
    elif args.gpus is not None:
        title = advisor_title(
            f"{args.gpus} x {asked.gpu_title}",
            f"{asked.quantization_title} on {asked.backend}",
            len(plans),
        )
        public = public_layouts(args.gpu, args.gpus)
        unmarked = (
            f"No row is marked *: no public deployment of Kimi-K3 on {args.gpus} "
            f"x {asked.gpu_title} states its layout that plan knows of."
            if args.gpu is not None
            else "No row is marked *: public layouts are known by GPU kind "
            "(--gpu NAME), not by memory."
        )
        print(
            advice(
                plans,
                refused,
                title,
                public,
                unmarked,
                lambda topology: plan_command(args, topology),
                step,
                given,
            )
        )
    else:
        # the GPU named once: the heading names it, the fits note its memory
        print(table(plans, None, (), asked.quantization_title, asked.gpu_title, given))
        print(serve_commands(plans))
    return 0


def advisor_title(gpus: str, served: str, layouts: int) -> str:
    """The advisor's first line: the GPUs (``32 x H20 (102.0 GB)``), the
    format on its kernel, how many layouts; the unit is on the next line,
    so that it keeps within 120 columns."""
    return f"Kimi-K3 on {gpus}: {served}, {layouts} layouts {VLLM} builds"


def _next_step(
    args: argparse.Namespace,
    asked: PlanInput,
    answers: Answers,
    plans: list[DeploymentPlan],
) -> list[str]:
    """Where no layout of ``--gpus`` fits: the fewest GPUs that fit and the
    formats that fit (``next_step``), as plan commands."""
    print(
        f"plan: no layout of {args.gpus} GPUs fits: sizing more GPUs and other "
        "formats ...",
        file=sys.stderr,
    )
    step = next_step(
        plans,
        args.gpus,
        args.gpus_per_node,
        asked.quantization,
        asked.backend,
        answers.advise,
        answers.plan_one,
        # another format's published config; not where --config declares one,
        # nor on an AMD GPU, where plan knows vLLM's MXFP4 kernels only
        other_formats=asked.quantization_config is None and asked.amd_arch is None,
    )
    return next_step_lines(
        step,
        args.gpus,
        asked.gpu_title or "",
        lambda gpus, **options: advisor_command(args, gpus, **options),
    )


def advisor_command(args: argparse.Namespace, gpus: int, **options: str) -> str:
    """The advisor's ``plan`` command for ``gpus`` GPUs, every other option
    as given, ``options`` (``quantization``, ``moe_backend``) replaced."""
    words = [PROG, "plan", "--gpus", str(gpus)]
    words += _gpu_words(args)
    given = {
        "quantization": args.quantization,
        "quantization_config": args.quantization_config,
        "config": args.config,
        "moe_backend": args.moe_backend
        if args.moe_backend.lower() != "marlin"
        else None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "reserve_gib": args.reserve_gib,
        "gpus_per_node": args.gpus_per_node
        if args.gpus_per_node != DEFAULT_GPUS_PER_NODE
        else None,
        "speculative_config": args.speculative_config,
        "model": args.model,
    }
    for name, value in {**given, **options}.items():
        if name == "moe_backend" and value == "marlin":
            continue
        if value is not None:
            text = f"{value:g}" if isinstance(value, float) else str(value)
            words += [f"--{name.replace('_', '-')}", text]
    if args.language_model_only:
        words.append("--language-model-only")
    return shlex.join(words)


def _note_kernel_not_verified(kernel: KernelOnGpu | None, gpu: str) -> None:
    """Say where whether the kernel runs on the GPU is not known here."""
    if kernel is not None and not kernel.verified:
        print(
            f"plan: note: whether vLLM's {kernel.kernel} (--moe-backend "
            f"{kernel.backend}) runs on {gpu} is not known here: its device "
            "check needs a library this machine lacks",
            file=sys.stderr,
        )


def _note_attention_borrowed(
    arch: str | None, gpu: str, plans: Sequence[DeploymentPlan]
) -> None:
    """On an AMD or Intel GPU, say in one line what is not sized as vLLM
    builds it there rather than borrow those figures silently: on XPU all
    but the MoE layers are NVIDIA's; on ROCm vLLM's AMD model is built
    whole, and only a build option of vLLM's ROCm wheel is unknown (where
    vLLM's KDA layer would use it)."""
    if arch == XPU:
        print(
            f"plan: note: on {gpu} only the MoE layers are sized as vLLM builds "
            "them on XPU; attention, its backend and the KV cache (per token, "
            "blocks, KDA state) are sized as on NVIDIA GPUs: XPU's attention is "
            "not built here",
            file=sys.stderr,
        )
    elif any(
        p.kv_cache is not None and p.kv_cache.kda_checkpoint_if_fused for p in plans
    ):
        print(
            f"plan: note: on {gpu} vLLM's ROCm KDA layers keep one more state "
            "block per request (a prefill checkpoint) where vLLM was built with "
            "its fused KDA chunk kernel, a build option this machine cannot "
            "tell: the KV cache is sized without it",
            file=sys.stderr,
        )


def _note_dsa_config_unread(text_config: dict[str, Any]) -> None:
    """A config's ``dsa_config`` on a vLLM that builds no DSA layers: say in
    one line that its attention was sized as this vLLM builds it."""
    if text_config.get("dsa_config") is not None and not builds_dsa_layers():
        print(
            f"plan: note: {VLLM} does not build DSA layers: the config's "
            "dsa_config is not read, and its layers are sized as the dense MLA "
            "this vLLM builds",
            file=sys.stderr,
        )


def _gpu_words(args: argparse.Namespace) -> list[str]:
    """The options that name the GPU asked: its preset, or its memory (and
    architecture)."""
    if args.gpu:
        return ["--gpu", args.gpu]
    given = memory_given(args)
    assert given is not None  # the advisor and next step need a GPU size
    return given.words + (["--gpu-arch", args.gpu_arch] if args.gpu_arch else [])


def plan_command(args: argparse.Namespace, topology: Topology) -> str:
    """The ``plan`` command that sizes ``topology`` alone, as the advisor
    sized it (every other option the advisor was given), and prints its
    ``vllm serve`` command."""
    words = [PROG, "plan"]
    words += _gpu_words(args)
    words += ["--tp", str(topology.tp_size)]
    for option, size in (
        ("--dcp", topology.dcp_size),
        ("--pp", topology.pp_size),
        ("--dp", topology.dp_size),
    ):
        if size > 1:
            words += [option, str(size)]
    if topology.expert_parallel:
        words.append("--ep")
    for option, value in (
        ("--quantization", args.quantization),
        ("--quantization-config", args.quantization_config),
        ("--config", args.config),
        (
            "--moe-backend",
            args.moe_backend if args.moe_backend.lower() != "marlin" else None,
        ),
        ("--kv-cache-dtype", args.kv_cache_dtype),
        ("--max-model-len", args.max_model_len),
        ("--gpu-memory-utilization", args.gpu_memory_utilization),
        ("--reserve-gib", args.reserve_gib),
        (
            "--gpus-per-node",
            args.gpus_per_node if args.gpus_per_node != DEFAULT_GPUS_PER_NODE else None,
        ),
        ("--speculative-config", args.speculative_config),
        ("--model", args.model),
    ):
        if value is not None:
            words += [option, f"{value:g}" if isinstance(value, float) else str(value)]
    if args.language_model_only:
        words.append("--language-model-only")
    return shlex.join(words)
