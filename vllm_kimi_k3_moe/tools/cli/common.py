"""What every subcommand's parser shares: one-line errors, number parsing,
vLLM's logs kept off stdout, and no background kernel builds in a CPU-only
tool process (vLLM's own flags, the topology, format and kernel options:
``vllm_flags``)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from vllm_kimi_k3_moe.formats import FORMATS

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


def fail(command: str, message: str) -> NoReturn:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def backends_by_format() -> str:
    """Each format's ``--moe-backend`` choices, for an epilog."""
    return "; ".join(f"{f.name}: {', '.join(f.moe_backends)}" for f in FORMATS)
