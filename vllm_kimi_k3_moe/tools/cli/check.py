"""``vllm-kimi-k3-moe check``: preflight a Kimi-K3 checkpoint from its
``config.json`` and shard headers, before the first launch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.tools.check.preflight import (
    PreflightInputError,
    PreflightReport,
    preflight,
)
from vllm_kimi_k3_moe.tools.check.report import allocation, summary, verdict
from vllm_kimi_k3_moe.tools.cli.common import (
    add_dp_and_ep,
    fail,
    positive_int,
    quiet_vllm,
)
from vllm_kimi_k3_moe.tools.plan.planner import PlanError, plan_deployment
from vllm_kimi_k3_moe.tools.topology import Deployment, DeploymentError, Topology

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def add_command(commands: Subcommands) -> None:
    check = commands.add_parser(
        "check",
        help="preflight a Kimi-K3 checkpoint before the first launch",
        description=(
            "Verify, from config.json and the safetensors shard headers only "
            "(never the tensor data; about 2 s for a release-sized header set), "
            "that every routed expert of every MoE layer (MTP draft included) "
            "has each of its gate/up/down tensors in the checkpoint's format "
            "(for example MXFP4's weight_packed and weight_scale), present once, "
            "with the format's dtype and logical shape, under the names vLLM's "
            "Kimi-K3 loader maps, and that the topology splits the experts "
            "evenly. Prints a summary, each GPU's share and every problem with "
            "the tensor name and what was expected. Formats: "
            f"{', '.join(f.title for f in FORMATS)}."
        ),
        epilog=(
            "Exit status: 0 no problem, 1 problems found (listed), 2 unusable "
            "input (no such directory, no config.json or shards, a quantization "
            "format check does not know, an unknown --moe-backend for the "
            "format, a config.json without the attention fields --moe-backend "
            "needs, or another bad option value)."
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
        type=positive_int,
        default=32,
        metavar="N",
        help="tensor-parallel size (default: 32)",
    )
    add_dp_and_ep(check)
    check.add_argument(
        "--moe-backend",
        metavar="NAME",
        help=f"also report what {VLLM} allocates per GPU on this MoE kernel, "
        "upstream and with this plugin, by building the checkpoint's language "
        "model on the meta device as plan does (imports vLLM: about 15 s "
        "more). Names as for plan --moe-backend",
    )
    check.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    parallelism = Topology(
        args.tp_size, dp_size=args.dp_size, expert_parallel=args.expert_parallel
    )
    backend = None if args.moe_backend is None else args.moe_backend.lower()
    try:  # refuses an unknown backend before reading the shards
        report = preflight(args.checkpoint, parallelism, backend)
    except PreflightInputError as error:
        fail("check", str(error))
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
    print(f"building vLLM's Kimi-K3 model for {backend} ...", file=sys.stderr)
    deployment = Deployment(
        tp_size=report.parallelism.tp_size,
        dp_size=report.parallelism.dp_size,
        expert_parallel=report.parallelism.expert_parallel,
        backend=backend,
        quantization=report.layout.format.format.name,
    )
    assert report.layout.language_model is not None  # read with --moe-backend
    try:
        with quiet_vllm():
            plan = plan_deployment(report.layout.language_model, deployment)
        print("\n".join(allocation(plan.moe)))
    except (DeploymentError, PlanError) as error:
        fail("check", str(error))
