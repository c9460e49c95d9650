"""Every command a page of the docs shows with its output (a ``console``
block: README.md and docs/*.md) is run on the installed vLLM and prints what
the page shows, ``...`` standing for what varies by run or machine
(``matching``). A block marked ``<!-- vLLM X.Y.Z -->`` is compared where
that release is installed; CI runs both releases. The README's figure is
what ``plan --plot`` draws on vLLM 0.34.0.

One test runs them all, in this process (one pytest-xdist worker), sharing
one answers cache and one planner per question asked of ``plan``
(``tests.shared_planners``), so the plans the docs show are built once; it
names every block that differs."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

from tests.docs.commands import Workspace, run
from tests.docs.markdown_blocks import REPO, Block, every_block
from tests.docs.matching import difference, matches
from tests.shared_planners import shared_planners
from vllm_kimi_k3_moe.tools.deployment.remembered import CACHE_VARIABLE

INSTALLED_VLLM = importlib.metadata.version("vllm")
CONSOLE = [block for block in every_block() if block.language == "console"]
FIGURE = Path("docs/plan-h20.svg")
FIGURE_RELEASE = "0.34.0"


def differs(block: Block, workspace: Workspace, capsys: Any) -> list[str]:
    """What of ``block`` the commands do not print as shown."""
    found = []
    for shown in block.shown():
        printed = run(shown.command, workspace, capsys)
        if not matches(shown.output, printed):
            diff = difference(shown.output, printed)
            found.append(f"{block.name}: $ {shown.command}\n{diff}")
    return found


def figure_differs(workspace: Workspace, capsys: Any) -> list[str]:
    drawn = workspace.headers.parent / FIGURE.name
    run(f"vllm-kimi-k3-moe plan --gpu h20 --plot {drawn}", workspace, capsys)
    if drawn.read_text() == (REPO / FIGURE).read_text():
        return []
    return [f"{FIGURE}: draw it again: vllm-kimi-k3-moe plan --gpu h20 --plot {FIGURE}"]


@pytest.mark.slow
def test_every_command_prints_what_the_docs_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    workspace = Workspace(tmp_path)
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "answers"))
    run_here = [b for b in CONSOLE if b.release in (None, INSTALLED_VLLM)]
    assert run_here, "no block shows this release"
    problems = []
    with shared_planners(monkeypatch):
        for block in run_here:
            problems += differs(block, workspace, capsys)
        if INSTALLED_VLLM == FIGURE_RELEASE:
            problems += figure_differs(workspace, capsys)
    assert not problems, "\n\n".join(problems)


def test_every_release_marked_is_one_ci_runs() -> None:
    assert {block.release for block in CONSOLE} <= {None, "0.33.0", "0.34.0"}


def test_serve_lines_are_shown_only_as_the_tools_print_them() -> None:
    """A ``vllm serve`` line an operator copies is one a run block prints:
    none is written by hand in another block."""
    for block in every_block():
        if block.language == "console":
            continue
        for line in block.lines:
            assert not line.strip().removeprefix("$ ").startswith("vllm serve "), (
                f"{block.name}: a vllm serve line no command prints: {line}"
            )
