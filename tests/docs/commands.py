"""Running a command the docs show, in this process, as an operator's shell
would: ``NAME=value`` settings before it, ``vllm-kimi-k3-moe ...`` (the
command line's ``main``), ``python -m benchmarks.NAME ...`` (its ``main``), and a
``| jq -r FILTER`` after it (the filters the docs use: ``.[N]``, ``.key``,
``[]``). ``/tmp/kimi-k3-headers``, the docs' header set, is a directory of
the test's own; the output says the docs' path again."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.aiter_shell import without_aiters_situv2
from vllm_kimi_k3_moe.tools import cli
from vllm_kimi_k3_moe.tools.deployment.remembered import vllm_environment

HEADERS = "/tmp/kimi-k3-headers"
SETTING = re.compile(r"^[A-Z][A-Z0-9_]*=")
JQ_STEP = re.compile(r"\.\[(\d+)\]|\.(\w+)|\[\]")


class Workspace:
    """What the commands of one test share: a directory for the
    docs' header set (written once, by the docs' own command or on first
    need)."""

    def __init__(self, directory: Path) -> None:
        self.headers = directory / "kimi-k3-headers"

    def local(self, word: str) -> str:
        return word.replace(HEADERS, str(self.headers))

    def ensure_headers(self) -> None:
        if not self.headers.exists():
            from benchmarks.header_set import write

            write(self.headers, "mxfp4")


def _benchmark(workspace: Workspace, argv: list[str]) -> None:
    """``python -m benchmarks.NAME ARGS``: the module's ``main``."""
    name, *args = argv
    if not name.startswith("benchmarks."):
        raise ValueError(f"a module the docs test does not run: {name}")
    if name == "benchmarks.header_set" and workspace.headers.exists():
        shutil.rmtree(workspace.headers)  # the docs' command writes it afresh
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [name, *args])
        importlib.import_module(name).main()


def _tool(argv: list[str]) -> None:
    # --version and --help exit; the status is not shown
    with contextlib.suppress(SystemExit):
        cli.main(argv)


RUNNERS: dict[tuple[str, ...], Callable[[Workspace, list[str]], None]] = {
    ("vllm-kimi-k3-moe",): lambda _, argv: _tool(argv),
    ("python", "-m"): _benchmark,
}


def jq(text: str, expression: str) -> str:
    """``jq -r EXPRESSION`` for the paths the docs use."""
    values: list[Any] = [json.loads(text)]
    for index, key in _steps(expression):
        if index is None and key is None:
            values = [item for value in values for item in value]
        else:
            values = [value[int(index) if index else key] for value in values]
    return "".join(f"{v if isinstance(v, str) else json.dumps(v)}\n" for v in values)


def _steps(expression: str) -> Iterator[tuple[str | None, str | None]]:
    position = 0
    for step in JQ_STEP.finditer(expression):
        if step.start() != position:
            raise ValueError(f"jq filter the docs test does not take: {expression}")
        position = step.end()
        yield step.group(1), step.group(2)
    if position != len(expression):
        raise ValueError(f"jq filter the docs test does not take: {expression}")


def run(command: str, workspace: Workspace, capsys: pytest.CaptureFixture) -> str:
    """What ``command`` prints on stdout (stderr, where progress and vLLM's
    own lines go, is left out)."""
    command, _, piped = command.partition(" | ")
    words = [workspace.local(word) for word in shlex.split(command)]
    settings = {}
    while words and SETTING.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        settings[name] = value
    prefix = next((p for p in RUNNERS if tuple(words[: len(p)]) == p), None)
    if prefix is None:
        raise ValueError(f"a command the docs test cannot run: {command}")
    if HEADERS in command and "benchmarks.header_set" not in words:
        workspace.ensure_headers()
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        without_aiters_situv2(patch)  # what an earlier command's vLLM set
        for name, value in settings.items():
            patch.setenv(name, value)
        vllm_environment.cache_clear()
        RUNNERS[prefix](workspace, words[len(prefix) :])
    vllm_environment.cache_clear()
    printed = capsys.readouterr().out
    if piped:
        program = shlex.split(piped)
        if program[:2] != ["jq", "-r"] or len(program) != 3:
            raise ValueError(f"a pipe the docs test cannot run: {piped}")
        printed = jq(printed, program[2])
    return printed.replace(str(workspace.headers), HEADERS)
