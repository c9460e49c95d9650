"""``vllm-kimi-k3-moe selftest``: on one GPU of the cluster, before the launch,
run every rank's partition of Kimi-K3's routed experts through the kernel
vLLM selects there, prove the ranks sum to the unsharded experts, and time
the plugin's partition against vLLM alone's."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats.w4a16 import ZERO_POINT
from vllm_kimi_k3_moe.tools.cli.common import (
    backends_by_format,
    config_file,
    fail,
    no_background_kernel_builds,
    quiet_vllm,
)
from vllm_kimi_k3_moe.tools.cli.vllm_flags import (
    add_dp_and_ep,
    add_format_and_backend,
    add_vllm_flag,
)
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    ConfigFileError,
    read_config_document,
    text_config_fields,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Topology,
)
from vllm_kimi_k3_moe.tools.deployment.tp_sizes import validate_deployment
from vllm_kimi_k3_moe.tools.selftest.checkpoint import (
    CheckpointInputError,
    ExpertCheckpoint,
    expert_data_is_zero,
    expert_keys,
    open_checkpoint,
    shard_of_each,
    zero_data_refusal,
)
from vllm_kimi_k3_moe.tools.selftest.dequantize import FORMATS as WITH_REFERENCE
from vllm_kimi_k3_moe.tools.selftest.harness import SelftestCase
from vllm_kimi_k3_moe.tools.selftest.interpreted_triton import (
    TRITON_BACKEND,
    InterpretedTriton,
    interpret_triton_if_possible,
)
from vllm_kimi_k3_moe.tools.selftest.kernels import kernel_path
from vllm_kimi_k3_moe.tools.selftest.report import as_json, screen
from vllm_kimi_k3_moe.tools.selftest.run import (
    SelftestResult,
    SelftestUnusable,
    run_selftest,
)
from vllm_kimi_k3_moe.tools.selftest.shape import moe_shape

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def add_command(commands: Subcommands) -> None:
    selftest = commands.add_parser(
        "selftest",
        help="on one GPU before the launch: every rank's MoE partition through "
        "the real kernel, summed against the unsharded experts, and timed "
        "against vLLM alone's",
        description=(
            "Build the Kimi-K3 routed-expert layer of every GPU of the layout "
            f"through the plugin ({VLLM}'s KimiMoE, the real 3072 "
            "intermediate rows split as on that GPU, the real 3584 width; "
            "twice top-k experts instead of 896, so every GPU's layer fits "
            "this one in turn), fill it from a synthetic checkpoint in the "
            "format (or --checkpoint's first MoE layer: only those tensors "
            "are read), load it through vLLM's loader, run vLLM's "
            "process_weights_after_loading and its MoE forward (the kernel "
            "--moe-backend selects on this GPU, Kimi-K3's routing and SiTU) "
            "at 1, 16 and 128 tokens, sum the GPUs as the all-reduce does, "
            "and compare with the unsharded experts in float64. GPU 0's "
            "layer is timed, and again with the plugin taken out of the "
            "process (vLLM alone's partition). Without a CUDA device the "
            "same harness runs every rank on vLLM's CPU reference kernel "
            "instead (with --moe-backend triton: vLLM's Triton kernel itself, "
            "run by Triton's interpreter), 256 wide, untimed, and says so in "
            "its first line."
        ),
        epilog=(
            f"MoE backends per format (--moe-backend): {backends_by_format()}. "
            "Exit status: 0 right; 1 wrong (a rank cannot be built or run, or "
            "the sum is off by more than twice the unsharded layer's own error "
            "on the same kernel); 2 unusable input, one line on stderr: a "
            "layout vLLM cannot build (as plan refuses it), an unknown "
            "format or backend, a checkpoint without the experts, a kernel "
            "that does not run the format on this machine at all."
        ),
    )
    add_vllm_flag(
        selftest,
        "--tensor-parallel-size",
        "tensor-parallel size (default: 32)",
        default=32,
    )
    add_dp_and_ep(selftest)
    add_format_and_backend(selftest)
    selftest.set_defaults(quantization=None)  # --checkpoint's, else mxfp4
    selftest.add_argument(
        "--config",
        type=config_file,
        metavar="PATH",
        help="a Hugging Face config.json (or a directory holding one) whose MoE "
        "fields replace Kimi-K3's "
        "published ones (may be nested under text_config)",
    )
    selftest.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="fill the experts from this checkpoint's first MoE layer instead "
        "of a synthetic one (its format and config are the checkpoint's)",
    )
    selftest.add_argument(
        "--json", action="store_true", help="print JSON instead of the report"
    )
    selftest.set_defaults(run=run)


@dataclass(frozen=True)
class SelftestInput:
    """What ``selftest`` was asked, validated."""

    case: SelftestCase
    checkpoint: ExpertCheckpoint | None


def _text_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.config is None:
        return KIMI_K3_TEXT_CONFIG
    return text_config_fields(read_config_document(args.config), args.config)


def _selftest_input(args: argparse.Namespace) -> SelftestInput:
    """Every input error ends the command here, before vLLM is imported."""
    checkpoint = None
    try:
        if args.checkpoint is not None:
            if args.config is not None:
                raise DeploymentError(
                    "give --checkpoint or --config, not both: the checkpoint's "
                    "config.json is the config"
                )
            checkpoint = open_checkpoint(args.checkpoint)
            found = checkpoint.layout.format.format.name
            if args.quantization not in (None, found):
                raise DeploymentError(
                    f"--quantization {args.quantization}, but "
                    f"{args.checkpoint} holds {found}; drop --quantization"
                )
            quantization, text_config = found, checkpoint.layout.text_config
        else:
            quantization, text_config = args.quantization or "mxfp4", _text_config(args)
        if (
            checkpoint is not None
            and ZERO_POINT in checkpoint.layout.format.tensors.suffixes
        ):
            raise DeploymentError(
                f"selftest has no FP32 reference for {checkpoint.layout.format.name} "
                "(its zero points): vLLM's dequantizer for them is to be added "
                "to tools/selftest/dequantize.py"
            )
        if quantization not in WITH_REFERENCE:
            raise DeploymentError(
                f"selftest has no FP32 reference for {quantization} (it has one "
                f"for {', '.join(WITH_REFERENCE)}): vLLM's dequantizer for it "
                "is to be added to tools/selftest/dequantize.py"
            )
        topology = Topology(
            args.tp_size, dp_size=args.dp_size, expert_parallel=args.expert_parallel
        )
        backend = args.moe_backend.lower()
        validate_deployment(text_config, Deployment.of(topology, backend, quantization))
        case = SelftestCase(quantization, topology, backend, text_config)
        if checkpoint is not None:
            shape = moe_shape(text_config, topology, reduced_width=False)
            shard_of_each(checkpoint, expert_keys(checkpoint.layout.format, shape))
            if expert_data_is_zero(checkpoint, checkpoint.layout.format, shape):
                raise DeploymentError(zero_data_refusal(checkpoint))
    except (ConfigFileError, DeploymentError, CheckpointInputError) as error:
        fail("selftest", str(error))
    return SelftestInput(case, checkpoint)


def _run(asked: SelftestInput, workdir: Path) -> SelftestResult:
    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:  # the CPU paths launch no GPU kernel
        no_background_kernel_builds()
    # Triton's kernel is the GPU's own: on a CPU its interpreter runs it, which
    # must be chosen before vLLM (and Triton) is imported
    interpreting = (
        on_cpu
        and asked.case.backend == TRITON_BACKEND
        and interpret_triton_if_possible()
    )
    # as vLLM's plugin loader does in every process it starts
    vllm_kimi_k3_moe.register()
    kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    path = InterpretedTriton() if interpreting else kernel_path()
    device = torch.cuda.get_device_name(path.device) if path.timed else "cpu"
    threads = torch.get_num_threads()
    if not path.timed:
        # The CPU reference at these small shapes: two threads waiting on
        # each other make it several times slower on a small shared machine
        # (47 s against 2 min 34 s for --tp 32, measured on 2 busy cores).
        torch.set_num_threads(1)
    try:
        return run_selftest(
            asked.case, path, kimi_model, workdir, asked.checkpoint, device
        )
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    asked = _selftest_input(args)
    print(
        "importing vLLM and running every GPU's Kimi-K3 MoE layer ...",
        file=sys.stderr,
    )
    try:
        with (
            quiet_vllm(),
            tempfile.TemporaryDirectory(prefix="kimi-k3-selftest-") as workdir,
        ):
            result = _run(asked, Path(workdir))
    except SelftestUnusable as error:
        fail("selftest", str(error))
    print(as_json(result) if args.json else screen(result))
    return 0 if result.ok else 1
