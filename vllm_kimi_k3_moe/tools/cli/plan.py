"""``vllm-kimi-k3-moe plan``: does Kimi-K3 fit a deployment's GPUs, and how
much KV cache is left, as vLLM allocates it upstream and with this plugin."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import FORMAT_NAMES, FORMATS
from vllm_kimi_k3_moe.tools.cli.common import (
    add_dp_and_ep,
    fail,
    fraction,
    positive_float,
    positive_int,
    send_vllm_logs_to_stderr,
)
from vllm_kimi_k3_moe.tools.gpu_budget import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_RESERVE_GIB,
    BudgetError,
    GpuBudget,
)
from vllm_kimi_k3_moe.tools.plan.planner import PlanError, plan_deployment
from vllm_kimi_k3_moe.tools.plan.report import as_json, table
from vllm_kimi_k3_moe.tools.text_config import (
    KIMI_K3_TEXT_CONFIG,
    ConfigFileError,
    read_language_model_config,
)
from vllm_kimi_k3_moe.tools.topology import (
    DEFAULT_MAX_MODEL_LEN,
    KV_CACHE_DTYPES,
    Deployment,
    DeploymentError,
    Serving,
    validate,
    validate_serving,
)

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_TP_SIZES = (8, 16, 32)


def _backends_by_format() -> str:
    return "; ".join(f"{f.name}: {', '.join(f.moe_backends)}" for f in FORMATS)


def add_command(commands: Subcommands) -> None:
    plan = commands.add_parser(
        "plan",
        help="does Kimi-K3 fit a deployment's GPUs, and how much KV cache is left",
        description=(
            f"Build {VLLM}'s whole Kimi-K3 language model (embeddings, 24 MLA "
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
        type=positive_int,
        nargs="+",
        metavar="N",
        help="tensor-parallel sizes, one table row each (default: 8 16 32)",
    )
    add_dp_and_ep(plan)
    plan.add_argument(
        "--quantization",
        choices=FORMAT_NAMES,
        default="mxfp4",
        help="the checkpoint's format, with the quantization config of its "
        "published checkpoint: mxfp4 (the release, compressed-tensors "
        "mxfp4-pack-quantized, which vLLM serves as native MXFP4), "
        "ct-mxfp4 (other compressed-tensors MXFP4), fp8-block, "
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
        type=positive_float,
        metavar="N",
        help="memory of one GPU in GiB (80 for H100, 96 for H20, 141 for "
        "H200): adds whether Kimi-K3 fits and the KV cache left per GPU",
    )
    plan.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="U",
        help="the share of each GPU vLLM takes, in (0, 1] (default: "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION:g}, {VLLM}'s)",
    )
    plan.add_argument(
        "--reserve-gib",
        type=fraction,
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
        type=positive_int,
        default=DEFAULT_MAX_MODEL_LEN,
        metavar="N",
        help=f"vLLM's --max-model-len, in tokens (default: {DEFAULT_MAX_MODEL_LEN})",
    )
    plan.add_argument(
        "--json", action="store_true", help="print JSON instead of the table"
    )
    plan.set_defaults(run=run)


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
        fail("plan", str(error))
    return PlanInput(text_config, deployments, serving, budget)


def run(args: argparse.Namespace) -> int:
    asked = _plan_input(args)
    send_vllm_logs_to_stderr()
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
        fail("plan", str(error))
    print(as_json(plans) if args.json else table(plans))
    return 0
