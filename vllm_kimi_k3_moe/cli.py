"""``vllm-kimi-k3-moe``: the plugin's command line.

``plan`` answers, before any GPU is involved, how much memory Kimi-K3's MoE
layers take per GPU for a deployment, as vLLM 0.33.0 allocates them and as it
does with this plugin installed. ``check`` verifies, from a checkpoint's
``config.json`` and shard headers, that every routed-expert tensor will land on
every rank, before a deployment spends its GPUs finding out. ``--version``
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from vllm_kimi_k3_moe.deployment import (
    BACKENDS,
    COMPRESSED_TENSORS_MXFP4_BACKENDS,
    NVIDIA_MXFP4_BACKENDS,
    Deployment,
    DeploymentError,
    Parallelism,
    validate,
)
from vllm_kimi_k3_moe.kimi_k3_text_config import (
    KIMI_K3_MOE_TEXT_CONFIG,
    ConfigFileError,
    read_text_config,
)

if TYPE_CHECKING:
    from vllm_kimi_k3_moe.checkpoint_preflight import PreflightReport

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
        from vllm_kimi_k3_moe.version_report import version_report

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


def add_plan_command(commands: Subcommands) -> None:
    plan = commands.add_parser(
        "plan",
        help="per-GPU memory of Kimi-K3's MoE layers for a deployment",
        description=(
            "Build vLLM 0.33.0's real Kimi-K3 MoE layer for rank 0 of each "
            "deployment on the meta device (no GPU, no weights), as upstream "
            "vLLM builds it and with this plugin, and report what it allocates "
            "per GPU. Without options: TP8, TP16 and TP32, no expert "
            "parallelism, native MXFP4 on Marlin, the embedded Kimi-K3 config."
        ),
        epilog=(
            f"MXFP4 backends (vLLM's Mxfp4MoeBackend names): "
            f"{', '.join(NVIDIA_MXFP4_BACKENDS)}. On the compressed-tensors path: "
            f"{', '.join(COMPRESSED_TENSORS_MXFP4_BACKENDS)}. Exit status: 0 "
            "printed, 2 unusable input."
        ),
    )
    plan.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="a Hugging Face config.json (the language model may be nested "
        "under text_config); default: the embedded Kimi-K3 text config "
        "(hidden 7168, latent 3584, moe_intermediate_size 3072, 896 experts, "
        "top-16, 2 shared, 92 of 93 layers MoE)",
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
        "--moe-backend",
        default="marlin",
        metavar="NAME",
        help="the MXFP4 MoE kernel vLLM runs (default: marlin; see below). "
        "'auto' is refused: vLLM resolves it from the GPU it starts on",
    )
    plan.add_argument(
        "--quantization",
        choices=tuple(BACKENDS),
        default="mxfp4",
        help="MXFP4 path: mxfp4 (native; the released mxfp4-pack-quantized "
        "checkpoint is rewritten to it) or compressed-tensors (other "
        "compressed-tensors MXFP4 formats); default: mxfp4",
    )
    plan.add_argument(
        "--gpu-memory-gib",
        type=_positive_float,
        metavar="N",
        help="also say whether the MoE-layer weights fit in N GiB per GPU",
    )
    plan.add_argument(
        "--json", action="store_true", help="print JSON instead of the table"
    )
    plan.set_defaults(run=run_plan)


def _plan_input(args: argparse.Namespace) -> tuple[dict[str, Any], list[Deployment]]:
    """The text config and the validated deployments: every input error ends
    the command here, before vLLM's import (the slow part)."""
    try:
        text_config = (
            KIMI_K3_MOE_TEXT_CONFIG
            if args.config is None
            else read_text_config(args.config)
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
    except (ConfigFileError, DeploymentError) as error:
        _fail("plan", str(error))
    return text_config, deployments


def run_plan(args: argparse.Namespace) -> int:
    text_config, deployments = _plan_input(args)
    _send_vllm_logs_to_stderr()
    from vllm_kimi_k3_moe.plan import PlanError, plan
    from vllm_kimi_k3_moe.plan_report import as_json, table

    plans = []
    try:
        for index, deployment in enumerate(deployments, 1):
            if len(deployments) > 1 or index == 1:
                print(
                    f"[{index}/{len(deployments)}] building {deployment.label()} "
                    "(upstream and fixed)"
                    + (", importing vLLM first" if index == 1 else ""),
                    file=sys.stderr,
                    flush=True,
                )
            plans.append(plan(text_config, deployment))
    except (DeploymentError, PlanError) as error:
        _fail("plan", str(error))
    render = as_json if args.json else table
    print(render(plans, args.gpu_memory_gib))
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
    from vllm_kimi_k3_moe.checkpoint_preflight import PreflightInputError, preflight
    from vllm_kimi_k3_moe.checkpoint_report import summary, verdict

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
    from vllm_kimi_k3_moe.checkpoint_report import allocation
    from vllm_kimi_k3_moe.plan import PlanError, plan

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
