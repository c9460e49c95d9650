"""``vllm-kimi-k3-moe``: the plugin's command line.

``plan`` answers, before any GPU is involved, whether Kimi-K3 in a given
format fits a deployment's GPUs and how much KV cache is then left, as vLLM
allocates it and as it does with this plugin installed. ``check`` verifies,
from a checkpoint's ``config.json`` and shard headers, that every
routed-expert tensor will land on every rank, before a deployment spends its
GPUs finding out. ``selftest``, on one GPU of the cluster, runs every
rank's partition through the kernel vLLM selects there and sums the ranks
against the unsharded experts. ``doctor`` asks vLLM's plugin loader
whether it loads the plugin under the current ``VLLM_PLUGINS`` and says
which server log line shows it is on. ``--version`` says what is installed
and what is supported, for bug reports.

Each subcommand is one module (``plan``, ``check``, ``selftest``, ``doctor``)
whose ``add_command``
adds its parser and names its ``run`` function (``set_defaults(run=...)``);
vLLM's own flags it takes come from one table (``vllm_flags``), what every
parser shares from ``common``; ``main`` parses and calls it. Input is
validated before vLLM is imported, and bad input ends with one line on
stderr and exit status 2 (a misspelt
command, choice or option naming the closest right one: ``suggest``); no
command at all prints the commands and how to get help (``overview``),
exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.tools.cli import check, doctor, plan, selftest
from vllm_kimi_k3_moe.tools.cli.common import PROG, USAGE_ERROR, OneLineErrorParser
from vllm_kimi_k3_moe.tools.cli.overview import overview
from vllm_kimi_k3_moe.tools.cli.version import version_report
from vllm_kimi_k3_moe.tools.meta_rank.quiet import show_what_vllm_prints
from vllm_kimi_k3_moe.tools.suggest import unrecognized

SUBCOMMANDS = (plan, check, selftest, doctor)


class _PrintVersion(argparse.Action):
    """``--version``: print ``version.version_report`` and exit 0. Unlike
    argparse's own version action, the metadata is read only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(version_report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=PROG, description=f"Tools of the vllm-kimi-k3-moe plugin for {VLLM}."
    )
    parser.add_argument(
        "--version",
        action=_PrintVersion,
        nargs=0,
        default=argparse.SUPPRESS,
        help="print this plugin's version, the vLLM series it supports and the "
        "vLLM installed (from package metadata: vLLM is not imported), then "
        "exit; whether vLLM loads the plugin: doctor",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_command(commands)
    for command in commands.choices.values():
        command.add_argument(
            "--verbose",
            action="store_true",
            help="show what vLLM, torch and their kernel libraries print while "
            "the command imports and builds them (by default kept off the "
            "screen, shown only when they fail)",
        )
    return parser


def _subcommand_parser(
    parser: argparse.ArgumentParser, name: str | None
) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:
        print(overview(parser), file=sys.stderr)
        return USAGE_ERROR
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = _subcommand_parser(parser, getattr(args, "command", None))
        command.error(unrecognized(extras, command))
    show_what_vllm_prints(args.verbose)
    return args.run(args)
