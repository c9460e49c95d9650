"""What every subcommand's parser shares: one-line errors, number parsing,
the topology options, and vLLM's logs kept off stdout."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

PROG = "vllm-kimi-k3-moe"
USAGE_ERROR = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input ends with one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


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


def fail(command: str, message: str) -> NoReturn:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def send_vllm_logs_to_stderr() -> None:
    """vLLM logs to stdout by default; keep stdout for the command's output."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
