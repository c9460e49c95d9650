"""What every subcommand's parser shares: one-line errors, number parsing,
the topology options (DP, EP, DCP, PCP), the format and kernel options,
vLLM's logs kept off stdout, and no background kernel builds in a CPU-only
tool process."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from vllm_kimi_k3_moe.formats import FORMAT_NAMES, FORMATS

# kept importable from here, where the commands find their shared helpers
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm  # noqa: F401
from vllm_kimi_k3_moe.tools.suggest import with_choice_suggested

PROG = "vllm-kimi-k3-moe"
USAGE_ERROR = 2
CONFIG_JSON = "config.json"

# humming (a vLLM 0.33.0 dependency, imported with vLLM's MoE kernels) starts
# two Python processes the moment it is imported, building its CUDA launcher
# and its NVRTC helper in the background (humming/ops/utils.py,
# humming/utils/nvrtc.py), unless this variable is exactly "1"; with it, each
# is built in the process that first launches a humming kernel. A tool that
# runs vLLM on the CPU never launches one: there the two builds only compete
# for the cores (each imports torch).
HUMMING_BACKGROUND_BUILDS = "HUMMING_DISABLE_PARALLEL_BUILD"


def no_background_kernel_builds() -> None:
    """Turn humming's background builds off in this process and its children,
    unless the environment already says otherwise. Only the tools call it,
    for their own CPU-only work: a serving process never imports them."""
    os.environ.setdefault(HUMMING_BACKGROUND_BUILDS, "1")


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input ends with one line on stderr and exit status 2; a value
    outside an argument's choices names the closest choice."""

    def error(self, message: str) -> NoReturn:
        message = with_choice_suggested(message)
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def finite_float(text: str) -> float:
    """A number that is one: ``inf`` and ``nan`` are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


fraction = finite_float  # range-checked where it is used (GpuBudget)


def config_file(text: str) -> Path:
    """``--config``: a ``config.json``, or a directory holding one (a
    checkpoint's, or the one file downloaded of it)."""
    path = Path(text)
    if path.is_dir():
        if not (path / CONFIG_JSON).is_file():
            raise argparse.ArgumentTypeError(
                f"{text} is a directory without a {CONFIG_JSON}"
            )
        return path / CONFIG_JSON
    return path


def add_dp_and_ep(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--dp",
        "--data-parallel-size",
        dest="dp_size",
        type=positive_int,
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


def add_context_parallel(command: argparse.ArgumentParser) -> None:
    """``--dcp`` and ``--pcp``, as vLLM's flags of those long names."""
    command.add_argument(
        "--dcp",
        "--decode-context-parallel-size",
        dest="dcp_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="decode-context-parallel size, dividing TP: the MLA KV cache is "
        "split over N GPUs of each TP group; no weight changes (default: 1)",
    )
    command.add_argument(
        "--pcp",
        "--prefill-context-parallel-size",
        dest="pcp_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="prefill-context-parallel size: only 1, vLLM's Kimi-K3 attention "
        "refuses more (default: 1)",
    )


def fail(command: str, message: str) -> NoReturn:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def add_format_and_backend(
    command: argparse.ArgumentParser, online: bool = False
) -> None:
    """``--quantization`` and ``--moe-backend``, as ``plan`` takes them
    (``online``: also vLLM's methods that quantize a BF16 checkpoint while
    loading it, which ``tools.plan.asked`` checks against vLLM's list)."""
    formats = (
        "the checkpoint's format, with its published quantization config: "
        "mxfp4 (the release, compressed-tensors mxfp4-pack-quantized, which "
        "vLLM serves as native MXFP4), ct-mxfp4 (other compressed-tensors "
        "MXFP4), fp8-block, nvfp4 (compressed-tensors), modelopt-nvfp4, "
        "w4a16 (INT4 in groups of 32), awq, gptq (INT4 in groups of 128), "
        "bf16 (default: what --config's quantization_config declares, any "
        "config vLLM takes, else mxfp4)"
    )
    if online:
        formats += (
            "; or a method of vLLM's --quantization that quantizes the BF16 "
            "checkpoint while loading it (fp8_per_block, fp8_per_tensor, "
            "fp8_per_channel, mxfp8, int8_per_channel_weight_only, "
            "nvfp4_per_token, fp8, experts_int8, ...: vLLM's names, as vllm "
            "serve takes them; mxfp4 names the release, or with --config of a "
            "BF16 checkpoint vLLM's online MXFP4)"
        )
    command.add_argument(
        "--quantization",
        type=str.lower,
        metavar="NAME" if online else None,
        choices=None if online else FORMAT_NAMES,
        help=formats,
    )
    command.add_argument(
        "--moe-backend",
        default="marlin",
        metavar="NAME",
        help="vLLM's --moe-backend, the MoE kernel (default: marlin; the "
        "format's choices are below); 'auto' is refused: vLLM resolves it "
        "from the GPU it starts on",
    )


def backends_by_format() -> str:
    """Each format's ``--moe-backend`` choices, for an epilog."""
    return "; ".join(f"{f.name}: {', '.join(f.moe_backends)}" for f in FORMATS)
