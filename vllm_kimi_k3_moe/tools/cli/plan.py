"""``vllm-kimi-k3-moe plan``: does Kimi-K3 fit, how, and with how much KV cache.

Two modes. With ``--gpus N`` (and a GPU: ``--gpu NAME`` or
``--gpu-memory-gib X``) the advisor lists every layout of exactly N GPUs
vLLM builds (DCP sizes included), fitting first and most KV cache first,
the public ones marked, with the ``vllm serve`` commands of the first few
and of the public ones, and the ``plan`` command (the other mode) that
prints any other layout's. With ``--tp`` (default 8 16 32, and
``--pp``/``--dp``/``--ep``/``--dcp``) one row per tensor-parallel size and,
given a GPU size, the ``vllm serve`` command of each layout that fits: plan
prints a command only where it says the layout fits. Every input error ends
the command before vLLM's model is imported (the slow part), in one line
with exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_kimi_k3_moe.compat import VLLM, builds_dsa_layers
from vllm_kimi_k3_moe.formats import FormatError, KimiK3Format, format_named, recognise
from vllm_kimi_k3_moe.formats.adapters import adapters_quantized
from vllm_kimi_k3_moe.tools.cli.common import (
    CONFIG_JSON,
    PROG,
    add_context_parallel,
    add_dp_and_ep,
    add_format_and_backend,
    backends_by_format,
    config_file,
    fail,
    fraction,
    max_model_len,
    no_background_kernel_builds,
    positive_float,
    positive_int,
    quiet_vllm,
)
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import (
    ACTIVATIONS_GIB,
    CONTEXT_GIB,
    BudgetError,
    GpuBudget,
)
from vllm_kimi_k3_moe.tools.deployment.gpus import GPU_PRESETS, GpuError, gpu_preset
from vllm_kimi_k3_moe.tools.deployment.kernel_gpus import (
    KernelOnGpu,
    kernel_utilization,
    refuse_a_kernel_the_gpu_cannot_run,
)
from vllm_kimi_k3_moe.tools.deployment.nodes import DEFAULT_GPUS_PER_NODE
from vllm_kimi_k3_moe.tools.deployment.remembered import CACHE_VARIABLE, remembered
from vllm_kimi_k3_moe.tools.deployment.speculation import (
    Speculation,
    read_speculative_config,
)
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    ConfigFileError,
    declared_quantization_config,
    read_config_document,
    read_language_model_config,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    DEFAULT_MAX_MODEL_LEN,
    KV_CACHE_DTYPES,
    Deployment,
    DeploymentError,
    Serving,
    Topology,
    validate,
    validate_backend,
    validate_prefill_context_parallel,
    validate_serving,
)
from vllm_kimi_k3_moe.tools.deployment.tp_sizes import validate_with_working_tp_sizes
from vllm_kimi_k3_moe.tools.plan.next_step import fitting, next_step, next_step_lines
from vllm_kimi_k3_moe.tools.plan.planner import PlanError, Planner
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

DEFAULT_TP_SIZES = (8, 16, 32)
T = TypeVar("T")


def _gpus() -> str:
    return ", ".join(f"{p.name} ({p.memory_gib:g} GiB)" for p in GPU_PRESETS.values())


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
            "Advisor: --gpus N with --gpu NAME (or --gpu-memory-gib X) lists "
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
            f"GPUs (--gpu): {_gpus()}: the memory a CUDA process sees. "
            f"MoE backends per format (--moe-backend): {backends_by_format()}. "
            "Exit status: 0 printed, 2 unusable input (one line on stderr)."
        ),
    )
    plan.add_argument(
        "--gpus",
        type=positive_int,
        metavar="N",
        help="advisor: every layout of exactly N GPUs (needs --gpu or "
        "--gpu-memory-gib; not with --tp/--pp/--dp/--ep/--dcp)",
    )
    plan.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"the GPU, for its memory: {', '.join(GPU_PRESETS)}",
    )
    plan.add_argument(
        "--gpu-memory-gib",
        type=positive_float,
        metavar="X",
        help="memory of one GPU in GiB as CUDA reports it, for any other GPU",
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
    plan.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp_sizes",
        type=positive_int,
        nargs="+",
        metavar="N",
        help="tensor-parallel sizes, one row each (default: 8 16 32)",
    )
    plan.add_argument(
        "--pp",
        "--pipeline-parallel-size",
        dest="pp_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="pipeline-parallel size: each stage sized from vLLM's layer split "
        "(default: 1)",
    )
    add_dp_and_ep(plan)
    add_context_parallel(plan)
    add_format_and_backend(plan)
    plan.add_argument(
        "--kv-cache-dtype",
        type=str.lower,
        choices=KV_CACHE_DTYPES,
        help="vLLM's --kv-cache-dtype: auto (bfloat16) or fp8 (default: auto); "
        "the table shows the KV cache with a GPU size",
    )
    plan.add_argument(
        "--max-model-len",
        metavar="N",
        help=f"vLLM's --max-model-len, in tokens, as vLLM reads it (131072, 128k "
        f"= 128000, 128K = 131072; default: {DEFAULT_MAX_MODEL_LEN}); the table "
        "shows the KV cache with a GPU size",
    )
    plan.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        metavar="U",
        help="the share of each GPU vLLM takes, in (0, 1] (default: unset, "
        f"what {VLLM} resolves it to, which plan's notes say; the serve "
        "commands carry it only where given); needs a GPU size",
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
    plan.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="vLLM's --speculative-config, as vllm serve takes it: method "
        '"dspark" with its draft ("model": a directory holding its config.json, '
        'or Inferact/Kimi-K3-DSpark) or "mtp" (the checkpoint\'s own MTP layers); '
        "vLLM builds the draft, its weights and KV cache are counted, and the "
        "serve commands carry it",
    )
    plan.add_argument(
        "--language-model-only",
        action="store_true",
        help="as vLLM's flag: serve without the vision tower (by default "
        "vLLM loads it: 0.9 GB per GPU of the first pipeline stage)",
    )
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
    plan.set_defaults(run=run)


@dataclass(frozen=True)
class PlanInput:
    """What ``plan`` was asked, validated."""

    text_config: dict[str, Any]
    quantization: str  # the format's name
    # --config's own quantization_config; None: the format's published one
    quantization_config: dict[str, Any] | None
    quantization_title: str  # how the tables name it
    deployments: list[Deployment]  # explicit mode; the advisor enumerates
    serving: Serving
    budget: GpuBudget | None
    gpu_title: str | None  # the preset's name, or the memory given, in GB
    backend: str  # --moe-backend, as vLLM spells it
    speculation: Speculation | None  # --speculative-config


def _budget(
    args: argparse.Namespace, quantization: str
) -> tuple[GpuBudget | None, str | None]:
    if args.gpu is not None and args.gpu_memory_gib is not None:
        raise BudgetError("give --gpu or --gpu-memory-gib, not both")
    if args.gpu is not None:
        preset = gpu_preset(args.gpu)
        memory, title = preset.memory_gib, preset.title
    elif args.gpu_memory_gib is not None:
        # in GB, the unit of the headings it appears in (GB = 10^9 bytes)
        memory = args.gpu_memory_gib
        title = f"{memory * 2**30 / 10**9:.1f} GB"
    else:
        for option, value in (
            ("--gpu-memory-utilization", args.gpu_memory_utilization),
            ("--reserve-gib", args.reserve_gib),
        ):
            if value is not None:
                raise BudgetError(
                    f"{option} needs a GPU size: add --gpu NAME or --gpu-memory-gib X"
                )
        return None, None
    # None: vLLM's default utilization and plan's estimate of the reserve,
    # which the installed vLLM decides once it is imported (kv_budget)
    utilization = args.gpu_memory_utilization
    if utilization is None:
        utilization = _kernel_utilization(quantization, args.moe_backend.lower())
    budget = GpuBudget(memory, utilization, args.reserve_gib)
    return budget, title


def _kernel_utilization(quantization: str, backend: str) -> float | None:
    """The ``--gpu-memory-utilization`` the kernel needs where it needs one
    (``kernel_gpus.KERNEL_UTILIZATION``), said on stderr; else None."""
    utilization = kernel_utilization(quantization, backend)
    if utilization is not None:
        print(
            f"plan: note: --moe-backend {backend} is sized and served at "
            f"--gpu-memory-utilization {utilization:g}, as vLLM's recipe runs it: "
            "its kernel allocates about 1.6 GiB outside vLLM's pool on its "
            "first forward",
            file=sys.stderr,
        )
    return utilization


def _note_kv_options_unused(args: argparse.Namespace) -> None:
    """The KV-cache options change the JSON (its serve commands and
    ``kv_cache_per_gpu``) but not a table without a GPU size: say so rather
    than ignore them silently."""
    given = [
        option
        for option, value in (
            ("--kv-cache-dtype", args.kv_cache_dtype),
            ("--max-model-len", args.max_model_len),
        )
        if value is not None
    ]
    if given:
        print(
            f"plan: note: {' and '.join(given)} "
            f"{'size' if len(given) > 1 else 'sizes'} the KV cache, which the "
            "table shows with a GPU size (--gpu NAME or --gpu-memory-gib X)",
            file=sys.stderr,
        )


def _note_preset_adapters(fmt: KimiK3Format) -> None:
    """Without --config a format is sized from its preset
    ``quantization_config``; whether that quantizes the latent adapters (on
    every GPU whole: 9.45 GB in BF16) is the assumption that moves the
    figures most, and a checkpoint's own config may differ: say which."""
    if not adapters_quantized(fmt.published_quantization_config(), None):
        return
    print(
        f"plan: note: {fmt.name} is sized from plan's preset config, which "
        "quantizes the latent adapters (routed_expert_down_proj, up_proj) as "
        "the experts; a checkpoint that keeps them BF16 holds more on every "
        "GPU: give its config.json (--config DIR) to size it as it is",
        file=sys.stderr,
    )


def _plan_input(args: argparse.Namespace) -> PlanInput:
    """Every input error ends the command here, before vLLM's model is
    imported (a --max-model-len is read last, by vLLM's own parser function)."""
    try:
        text_config = (
            KIMI_K3_TEXT_CONFIG
            if args.config is None
            else read_language_model_config(args.config)
        )
        fmt, quantization_config, quantization_title = _quantization(args)
        budget, gpu_title = _budget(args, fmt.name)
        validate_prefill_context_parallel(args.pcp_size)
        speculation = (
            None
            if args.speculative_config is None
            else read_speculative_config(args.speculative_config, text_config)
        )
        backend = args.moe_backend.lower()
        if args.gpus is not None:
            explicit = [
                option
                for option, given in (
                    ("--tp", args.tp_sizes is not None),
                    ("--pp", args.pp_size != 1),
                    ("--dp", args.dp_size != 1),
                    ("--ep", args.expert_parallel),
                    ("--dcp", args.dcp_size != 1),
                )
                if given
            ]
            if explicit:
                raise DeploymentError(
                    f"--gpus lists every layout itself; drop {', '.join(explicit)}"
                )
            if budget is None:
                raise DeploymentError(
                    "--gpus needs a GPU size: add --gpu NAME or --gpu-memory-gib X"
                )
            validate_backend(fmt.name, backend)
            deployments, left_out = [], []
        else:
            deployments = [
                Deployment(
                    tp,
                    dp_size=args.dp_size,
                    pp_size=args.pp_size,
                    expert_parallel=args.expert_parallel,
                    dcp_size=args.dcp_size,
                    backend=backend,
                    quantization=fmt.name,
                )
                for tp in args.tp_sizes or DEFAULT_TP_SIZES
            ]
            deployments, left_out = _buildable(
                text_config, deployments, args.tp_sizes is None
            )
        default = Serving()
        serving = Serving(  # --max-model-len last: vLLM's parser imports torch
            args.kv_cache_dtype or default.kv_cache_dtype,
            default.max_model_len
            if args.max_model_len is None
            # vLLM's own reading, kept: asked again, vLLM is not imported
            else remembered(
                ("vLLM's --max-model-len", args.max_model_len),
                lambda: max_model_len(args.max_model_len),
            ),
            args.language_model_only,
        )
        validate_serving(serving)
    except (ConfigFileError, DeploymentError, BudgetError, GpuError, FormatError) as e:
        fail("plan", str(e))
    # after every error: those are one line
    for line in left_out:
        print(line, file=sys.stderr)
    if budget is None and not args.json:
        _note_kv_options_unused(args)
    if quantization_config is None:
        _note_preset_adapters(fmt)
    return PlanInput(
        text_config,
        fmt.name,
        quantization_config,
        quantization_title,
        deployments,
        serving,
        budget,
        gpu_title,
        backend,
        speculation,
    )


def _quantization(
    args: argparse.Namespace,
) -> tuple[KimiK3Format, dict[str, Any] | None, str]:
    """The format to size, the quantization_config to build it from (None:
    its published one) and its name for the tables: ``--config``'s own
    ``quantization_config`` where it declares one (any config vLLM takes:
    INT4 or INT8 in any group, symmetric or not, AutoAWQ, AutoGPTQ), as vLLM
    will pick the experts' method, else ``--quantization`` (mxfp4 by
    default)."""
    declared = None
    if args.config is not None:
        declared = declared_quantization_config(read_config_document(args.config))
    if declared is None:
        fmt = format_named(args.quantization or "mxfp4")
        return fmt, None, fmt.title
    recognised = recognise(declared, None, str(args.config))
    if args.quantization not in (None, recognised.format.name):
        raise DeploymentError(
            f"--quantization {args.quantization}, but {args.config} declares "
            f"{recognised.name} ({recognised.format.name}); drop --quantization"
        )
    return recognised.format, declared, recognised.name


def _buildable(
    text_config: dict[str, Any], deployments: list[Deployment], defaults: bool
) -> tuple[list[Deployment], list[str]]:
    """The deployments vLLM builds. Sizes the operator named must all build
    (the first that does not is the error); of the default TP sizes, those
    that do not are left out, each said in a line for stderr, unless none
    builds (then the first one's reason is the error)."""
    kept, left_out = [], []
    for deployment in deployments:
        try:
            validate(text_config, deployment)
        except DeploymentError as error:
            if not defaults:
                validate_with_working_tp_sizes(text_config, deployment)
                raise
            left_out.append((deployment, error))
            continue
        kept.append(deployment)
    if not kept:
        raise left_out[0][1]
    return kept, [f"plan: left out {d.label()}: {error}" for d, error in left_out]


def served_model(model: str | None, config: Path | None) -> str:
    """The checkpoint the serve commands name: ``--model``; else the
    directory of the ``config.json`` that ``--config`` read (whose model
    plan sized); else the release."""
    if model is not None:
        return model
    if config is not None and config.name == CONFIG_JSON:
        return str(config.parent)
    return DEFAULT_MODEL


class Answers:
    """The plans of what ``plan`` was asked: kept from before where the same
    question was answered on the same installation (``remembered``), else
    worked out by one ``Planner`` (made, importing vLLM, on the first
    question not kept)."""

    def __init__(self, args: argparse.Namespace, asked: PlanInput) -> None:
        self._asked = asked
        self._model = served_model(args.model, args.config)
        self._gpus_per_node = args.gpus_per_node
        self._planner: Planner | None = None

    def _question(self, *what: Any) -> tuple[Any, ...]:
        asked = self._asked
        return (
            "plan",
            asked.text_config,
            asked.quantization_config,
            asked.serving,
            asked.budget,
            self._model,
            self._gpus_per_node,
            asked.speculation,
            *what,
        )

    def _worked_out(self, work: Callable[[Planner], T]) -> T:
        """``work`` on the planner, made on first use (vLLM's output kept
        off the terminal)."""
        if self._planner is None:
            print("importing vLLM and building its Kimi-K3 model ...", file=sys.stderr)
            asked = self._asked
            with quiet_vllm():
                self._planner = Planner(
                    asked.text_config,
                    asked.serving,
                    asked.budget,
                    self._model,
                    asked.quantization_config,
                    self._gpus_per_node,
                    asked.speculation,
                )
        with quiet_vllm():
            return work(self._planner)

    def advise(
        self, gpus: int, quantization: str | None = None, backend: str | None = None
    ) -> tuple[list[DeploymentPlan], list[str]]:
        """``Planner.advise`` of ``gpus`` GPUs in the format and kernel (by
        default the asked ones)."""
        quantization = quantization or self._asked.quantization
        backend = backend or self._asked.backend
        return remembered(
            self._question("advise", gpus, quantization, backend),
            lambda: self._worked_out(
                lambda planner: planner.advise(gpus, quantization, backend)
            ),
        )

    def plan(self, deployments: list[Deployment]) -> list[DeploymentPlan]:
        """``Planner.plan`` of each of ``deployments``."""
        return remembered(
            self._question("plan", deployments),
            lambda: self._worked_out(
                lambda planner: [planner.plan(d) for d in deployments]
            ),
        )

    def plan_one(self, deployment: Deployment) -> DeploymentPlan:
        return self.plan([deployment])[0]

    def kernel_on_gpu(self, gpu: str, deployment: Deployment) -> KernelOnGpu:
        """vLLM's kernel for ``deployment``'s ``--moe-backend`` on ``gpu``
        (``DeploymentError`` where it selects none, which is not kept)."""
        asked = self._asked
        return remembered(
            self._question("kernel", gpu, deployment),
            lambda: self._worked_out(
                lambda planner: refuse_a_kernel_the_gpu_cannot_run(
                    asked.text_config, deployment, gpu, asked.quantization_config
                )
            ),
        )

    def note_if_kept(self) -> None:
        """Say (stderr) that no model was built: every answer was kept."""
        if self._planner is None:
            print(
                "plan: asked before on this vLLM, plugin and config: the kept "
                f"answer, vLLM not imported ({CACHE_VARIABLE}=off builds again)",
                file=sys.stderr,
            )

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()


def run(args: argparse.Namespace) -> int:
    no_background_kernel_builds()  # plan runs vLLM on the meta device only
    asked = _plan_input(args)
    answers = Answers(args, asked)
    step: list[str] = []
    try:
        kernel = _refuse_a_kernel_the_gpu_cannot_run(args, asked, answers)
        if args.gpus is not None:
            plans, refused = answers.advise(args.gpus)
            if not fitting(plans):
                step = _next_step(args, asked, answers, plans)
        else:
            plans, refused = answers.plan(asked.deployments), []
    except (DeploymentError, PlanError, BudgetError) as error:
        fail("plan", str(error))
    finally:
        answers.close()
    answers.note_if_kept()
    _note_dsa_config_unread(asked.text_config)
    _note_kernel_not_verified(kernel, args.gpu)
    if args.json:
        print(as_json(plans))
    elif args.wide:
        print(wide_table(plans, asked.quantization_title))
        print(serve_commands(plans))
    elif args.gpus is not None:
        title = (
            f"Kimi-K3 on {args.gpus} x {asked.gpu_title}: "
            f"{asked.quantization_title} on {asked.backend}, {len(plans)} layouts "
            f"{VLLM} builds, GB = 10^9 bytes"
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
            )
        )
    else:
        print(table(plans, format_title=asked.quantization_title))
        print(serve_commands(plans))
    return 0


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
        # another format's published config; not where --config declares one
        other_formats=asked.quantization_config is None,
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
    words += (
        ["--gpu", args.gpu]
        if args.gpu
        else ["--gpu-memory-gib", f"{args.gpu_memory_gib:g}"]
    )
    given = {
        "quantization": args.quantization,
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


def _refuse_a_kernel_the_gpu_cannot_run(
    args: argparse.Namespace, asked: PlanInput, answers: Answers
) -> KernelOnGpu | None:
    """With ``--gpu NAME``: vLLM's kernel for ``--moe-backend`` on that
    GPU; ``DeploymentError`` where it selects none (``kernel_gpus``)."""
    if args.gpu is None:
        return None
    deployment = (
        asked.deployments[0]
        if asked.deployments
        else Deployment(1, backend=asked.backend, quantization=asked.quantization)
    )
    return answers.kernel_on_gpu(args.gpu, deployment)


def _note_kernel_not_verified(kernel: KernelOnGpu | None, gpu: str) -> None:
    """Say where whether the kernel runs on the GPU is not known here."""
    if kernel is not None and not kernel.verified:
        print(
            f"plan: note: whether vLLM's {kernel.kernel} (--moe-backend "
            f"{kernel.backend}) runs on {gpu} is not known here: its device "
            "check needs a library this machine lacks",
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


def plan_command(args: argparse.Namespace, topology: Topology) -> str:
    """The ``plan`` command that sizes ``topology`` alone, as the advisor
    sized it (every other option the advisor was given), and prints its
    ``vllm serve`` command."""
    words = [PROG, "plan"]
    words += (
        ["--gpu", args.gpu]
        if args.gpu
        else ["--gpu-memory-gib", f"{args.gpu_memory_gib:g}"]
    )
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
        ("--config", args.config),
        (
            "--moe-backend",
            args.moe_backend if args.moe_backend.lower() != "marlin" else None,
        ),
        ("--kv-cache-dtype", args.kv_cache_dtype),
        ("--max-model-len", args.max_model_len),
        ("--gpu-memory-utilization", args.gpu_memory_utilization),
        ("--reserve-gib", args.reserve_gib),
        ("--model", args.model),
    ):
        if value is not None:
            words += [option, f"{value:g}" if isinstance(value, float) else str(value)]
    if args.language_model_only:
        words.append("--language-model-only")
    return shlex.join(words)
