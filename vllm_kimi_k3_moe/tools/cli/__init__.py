"""``vllm-kimi-k3-moe``: the plugin's command line.

``plan`` answers, before any GPU is involved, whether Kimi-K3 in a given
format fits a deployment's GPUs and how much KV cache is then left, as vLLM
0.33.0 allocates it and as it does with this plugin installed. ``check``
verifies, from a checkpoint's ``config.json`` and shard headers, that every
routed-expert tensor will land on every rank, before a deployment spends its
GPUs finding out. ``--version``
says what is installed and what is supported, for bug reports.

Each subcommand is one ``add_*_command`` function that adds its parser and
names its run function (``set_defaults(run=...)``); ``main`` parses and calls
it. Input is validated before vLLM is imported, and bad input ends with one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from vllm_kimi_k3_moe.tools.gpu_budget import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_RESERVE_GIB,
    BudgetError,
    GpuBudget,
)
from vllm_kimi_k3_moe.tools.text_config import (
    KIMI_K3_TEXT_CONFIG,
    ConfigFileError,
    read_language_model_config,
)
from vllm_kimi_k3_moe.tools.topology import (
    BACKENDS,
    DEFAULT_MAX_MODEL_LEN,
    KV_CACHE_DTYPES,
    QUANTIZATION_PATHS,
    Deployment,
    DeploymentError,
    Parallelism,
    Serving,
    validate,
    validate_serving,
)

if TYPE_CHECKING:
    from vllm_kimi_k3_moe.tools.check.preflight import PreflightReport

    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

PROG = "vllm-kimi-k3-moe"
DEFAULT_TP_SIZES = (8, 16, 32)
USAGE_ERROR = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input ends with one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


class _PrintVersion(argparse.Action):
    """``--version``: print ``version_report`` and exit 0. Unlike argparse's
    own version action, the metadata is read only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        from vllm_kimi_k3_moe.tools.cli.version import version_report

        print(version_report())
        parser.exit()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _add_dp_and_ep(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--dp",
        "--data-parallel-size",
        dest="dp_size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="data-parallel size (default: 1)",
    )
    command.add_argument(
        "--ep",
        "--enable-expert-parallel",
        dest="expert_parallel",
        action="store_true",
        help="expert parallelism over TP x DP GPUs, as vLLM's flag of that name",
    )


def _fail(command: str, message: str) -> NoReturn:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def _send_vllm_logs_to_stderr() -> None:
    """vLLM logs to stdout by default; keep stdout for the command's output."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _backends_by_format() -> str:
    return "; ".join(
        f"{quantization}: {', '.join(backends)}"
        for quantization, backends in BACKENDS.items()
    )


def add_plan_command(commands: Subcommands) -> None:
    plan = commands.add_parser(
        "plan",
        help="does Kimi-K3 fit a deployment's GPUs, and how much KV cache is left",
        description=(
            "Build vLLM 0.33.0's whole Kimi-K3 language model (embeddings, 24 MLA "
            "and 69 KDA attention layers, the dense layer, 92 MoE layers, "
            "lm_head) for rank 0 of each deployment on the meta device (no GPU, "
            "no weights), as upstream vLLM builds it and with this plugin, and "
            "report what it allocates per GPU: the MoE layers and the whole "
            "model. With --gpu-memory-gib, also whether it fits and how much KV "
            "cache vLLM would allocate next to it, from the KV-cache specs of "
            "the built layers. Without options: TP8, TP16 and TP32, no expert "
            "parallelism, the released MXFP4 format on Marlin, Kimi-K3's "
            "published text config."
        ),
        epilog=(
            f"MoE backends per format (--moe-backend): {_backends_by_format()}. "
            "The MXFP4 formats take vLLM's Mxfp4MoeBackend names, the others "
            "vLLM's --moe-backend names. Exit status: 0 printed, 2 unusable "
            "input."
        ),
    )
    plan.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="a Hugging Face config.json with Kimi-K3's whole text config "
        "(may be nested under text_config; MoE and attention fields both "
        "needed); default: Kimi-K3's published text_config (hidden 7168, "
        "93 layers: 24 MLA + 69 KDA, 92 MoE with 896 experts of 3072, "
        "latent 3584, vocab 163840)",
    )
    plan.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp_sizes",
        type=_positive_int,
        nargs="+",
        metavar="N",
        help="tensor-parallel sizes, one table row each (default: 8 16 32)",
    )
    _add_dp_and_ep(plan)
    plan.add_argument(
        "--quantization",
        choices=QUANTIZATION_PATHS,
        default="mxfp4",
        help="the checkpoint's format, with the quantization config of its "
        "published checkpoint: mxfp4 (the release, compressed-tensors "
        "mxfp4-pack-quantized, which vLLM serves as native MXFP4), "
        "compressed-tensors (other compressed-tensors MXFP4), fp8-block, "
        "nvfp4 (compressed-tensors), modelopt-nvfp4, w4a16 (INT4), bf16; "
        "default: mxfp4",
    )
    plan.add_argument(
        "--moe-backend",
        default="marlin",
        metavar="NAME",
        help="the MoE kernel vLLM runs (default: marlin; the format's choices "
        "are below). 'auto' is refused: vLLM resolves it from the GPU it "
        "starts on",
    )
    plan.add_argument(
        "--gpu-memory-gib",
        type=_positive_float,
        metavar="N",
        help="memory of one GPU in GiB (80 for H100, 96 for H20, 141 for "
        "H200): adds whether Kimi-K3 fits and the KV cache left per GPU",
    )
    plan.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="U",
        help="the share of each GPU vLLM takes, in (0, 1] (default: "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION:g}, vLLM 0.33.0's)",
    )
    plan.add_argument(
        "--reserve-gib",
        type=_fraction,
        default=DEFAULT_RESERVE_GIB,
        metavar="N",
        help="GiB per GPU kept for activations, CUDA graphs and communication "
        f"workspaces (default: {DEFAULT_RESERVE_GIB:g}, an estimate: vLLM "
        "measures them at start-up; use the figure its log gives)",
    )
    plan.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="vLLM's --kv-cache-dtype: auto (bfloat16) or fp8 (default: auto)",
    )
    plan.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=DEFAULT_MAX_MODEL_LEN,
        metavar="N",
        help=f"vLLM's --max-model-len, in tokens (default: {DEFAULT_MAX_MODEL_LEN})",
    )
    plan.add_argument(
        "--json", action="store_true", help="print JSON instead of the table"
    )
    plan.set_defaults(run=run_plan)


@dataclass(frozen=True)
class PlanInput:
    """What ``plan`` was asked, validated."""

    text_config: dict[str, Any]
    deployments: list[Deployment]
    serving: Serving
    budget: GpuBudget | None


def _plan_input(args: argparse.Namespace) -> PlanInput:
    """The text config, deployments, serving settings and GPU budget: every
    input error ends the command here, before vLLM's import (the slow part)."""
    try:
        text_config = (
            KIMI_K3_TEXT_CONFIG
            if args.config is None
            else read_language_model_config(args.config)
        )
        deployments = [
            Deployment(
                tp_size=tp,
                dp_size=args.dp_size,
                expert_parallel=args.expert_parallel,
                backend=args.moe_backend.lower(),
                quantization=args.quantization,
            )
            for tp in args.tp_sizes or DEFAULT_TP_SIZES
        ]
        for deployment in deployments:
            validate(text_config, deployment)
        serving = Serving(args.kv_cache_dtype, args.max_model_len)
        validate_serving(serving)
        # without a GPU size there is nothing to fit: no budget
        budget = (
            None
            if args.gpu_memory_gib is None
            else GpuBudget(
                args.gpu_memory_gib, args.gpu_memory_utilization, args.reserve_gib
            )
        )
    except (ConfigFileError, DeploymentError, BudgetError) as error:
        _fail("plan", str(error))
    return PlanInput(text_config, deployments, serving, budget)


def run_plan(args: argparse.Namespace) -> int:
    asked = _plan_input(args)
    _send_vllm_logs_to_stderr()
    from vllm_kimi_k3_moe.tools.plan.planner import PlanError, plan_deployment
    from vllm_kimi_k3_moe.tools.plan.report import as_json, table

    plans = []
    count = len(asked.deployments)
    try:
        for index, deployment in enumerate(asked.deployments, 1):
            print(
                f"[{index}/{count}] building {deployment.label()} (upstream and "
                "fixed)" + (", importing vLLM first" if index == 1 else ""),
                file=sys.stderr,
                flush=True,
            )
            plans.append(
                plan_deployment(
                    asked.text_config, deployment, asked.serving, asked.budget
                )
            )
    except (DeploymentError, PlanError) as error:
        _fail("plan", str(error))
    print(as_json(plans) if args.json else table(plans))
    return 0


def add_check_command(commands: Subcommands) -> None:
    check = commands.add_parser(
        "check",
        help="preflight a Kimi-K3 checkpoint before the first launch",
        description=(
            "Verify, from config.json and the safetensors shard headers only "
            "(never the tensor data; under 2 s for a release-sized header set), "
            "that every routed expert of every MoE layer (MTP draft included) "
            "has its gate/up/down weight_packed and weight_scale tensors, "
            "present once, uint8, with the logical MXFP4 shape, under the "
            "names vLLM's Kimi-K3 loader maps, and that the topology splits "
            "the experts evenly. Prints a summary, each GPU's share and every "
            "problem with the tensor name and the expected and actual shape."
        ),
        epilog=(
            "Exit status: 0 no problem, 1 problems found (listed), 2 unusable "
            "input (no such directory, no config.json or shards, not an MXFP4 "
            "checkpoint, unknown option value)."
        ),
    )
    check.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT_DIR",
        help="directory with config.json, model.safetensors.index.json and "
        "the shards (the files vLLM would load)",
    )
    check.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp_size",
        type=_positive_int,
        default=32,
        metavar="N",
        help="tensor-parallel size (default: 32)",
    )
    _add_dp_and_ep(check)
    check.add_argument(
        "--moe-backend",
        metavar="NAME",
        help="also report what vLLM 0.33.0 allocates per GPU on this MXFP4 "
        "kernel, upstream and with this plugin, by building its MoE layer on "
        "the meta device (imports vLLM: about 11 s more). Names as for plan",
    )
    check.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    # Imported here: plan needs neither them nor the shard-header reader.
    from vllm_kimi_k3_moe.tools.check.preflight import PreflightInputError, preflight
    from vllm_kimi_k3_moe.tools.check.report import summary, verdict

    parallelism = Parallelism(args.tp_size, args.dp_size, args.expert_parallel)
    backend = None if args.moe_backend is None else args.moe_backend.lower()
    try:  # refuses an unknown backend before reading the shards
        report = preflight(args.checkpoint, parallelism, backend)
    except PreflightInputError as error:
        _fail("check", str(error))
    print("\n".join(summary(report)), flush=True)
    # A topology that does not divide the model has no layer to build; the
    # verdict lists it as a problem.
    if backend is not None and report.share is not None:
        _print_vllm_allocation(report, backend)
    print("\n".join(verdict(report)))
    return 1 if report.problems else 0


def _print_vllm_allocation(report: PreflightReport, backend: str) -> None:
    """check --moe-backend: what vLLM allocates for the checkpoint's
    deployment, upstream and with the plugin (imports vLLM)."""
    print(f"building vLLM's MoE layer for {backend} ...", file=sys.stderr)
    _send_vllm_logs_to_stderr()
    from vllm_kimi_k3_moe.tools.check.report import allocation
    from vllm_kimi_k3_moe.tools.plan.planner import PlanError, plan

    deployment = Deployment(
        tp_size=report.parallelism.tp_size,
        dp_size=report.parallelism.dp_size,
        expert_parallel=report.parallelism.expert_parallel,
        backend=backend,
        quantization=report.layout.format.plan_path,
    )
    try:
        print("\n".join(allocation(plan(report.layout.text_config, deployment))))
    except (DeploymentError, PlanError) as error:
        _fail("check", str(error))


SUBCOMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    add_plan_command,
    add_check_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=PROG, description="Tools of the vllm-kimi-k3-moe plugin for vLLM 0.33.0."
    )
    parser.add_argument(
        "--version",
        action=_PrintVersion,
        nargs=0,
        default=argparse.SUPPRESS,
        help="print this plugin's version, the vLLM series it supports and the "
        "vLLM installed (from package metadata: vLLM is not imported), then exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in SUBCOMMANDS:
        add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
