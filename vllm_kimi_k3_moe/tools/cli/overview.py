"""What a bare ``vllm-kimi-k3-moe`` prints: the commands, each in a line,
the first command to try and how to get help."""

from __future__ import annotations

import argparse
import textwrap

from vllm_kimi_k3_moe.tools.cli.common import PROG

FIRST = f"{PROG} plan --gpu h20 --tp 32"
WIDTH = 88


def commands(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(name, help) of each subcommand, as ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return [(a.dest, a.help or "") for a in action._choices_actions]
    return []


def overview(parser: argparse.ArgumentParser) -> str:
    named = commands(parser)
    indent = 2 + max(len(name) for name, _ in named) + 2
    lines = [f"usage: {PROG} COMMAND [options]", "", "commands:"]
    for name, text in named:
        wrapped = textwrap.wrap(text, WIDTH - indent) or [""]
        lines.append(f"  {name:<{indent - 4}}  {wrapped[0]}")
        lines += [" " * indent + rest for rest in wrapped[1:]]
    lines += [
        "",
        f"first:  {FIRST}",
        f"help:   {PROG} COMMAND --help; {PROG} --help; {PROG} --version",
    ]
    return "\n".join(lines)
