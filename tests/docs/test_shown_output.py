"""Every command a page of the docs shows with its output (a ``console``
block: README.md and docs/*.md) is run on the installed vLLM and prints what
the page shows, ``...`` standing for what varies by run or machine
(``matching``). A block marked ``<!-- vLLM X.Y.Z -->`` is compared where
that release is installed; CI runs both releases.

The commands run in this process and share one answers cache and one
planner per question asked of ``plan`` (as the suite's planner fixtures do),
so the plans the docs show are built once."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pytest

from tests.docs.commands import Workspace, run
from tests.docs.markdown_blocks import REPO, Block, every_block
from tests.docs.matching import difference, matches
from vllm_kimi_k3_moe.tools.deployment.remembered import CACHE_VARIABLE
from vllm_kimi_k3_moe.tools.plan import answers

INSTALLED_VLLM = importlib.metadata.version("vllm")
CONSOLE = [block for block in every_block() if block.language == "console"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def shared_planners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``answers.Planner`` made once per set of arguments for the module, and
    an answers cache of the module's own."""
    made: dict[str, Any] = {}
    real = answers.Planner
    cache = tmp_path_factory.mktemp("answers")

    class Kept(real):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            """Kept open for the module's next command (the command closes
            the planner it made)."""

    def planner(*args: Any) -> Any:
        key = repr(args)
        if key not in made:
            made[key] = Kept(*args)
        return made[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answers, "Planner", planner)
        yield cache
    for made_planner in made.values():
        real.close(made_planner)


@pytest.mark.parametrize("block", CONSOLE, ids=lambda block: block.name)
def test_each_command_prints_what_the_docs_show(
    block: Block,
    workspace: Workspace,
    shared_planners: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    if block.release not in (None, INSTALLED_VLLM):
        pytest.skip(f"shows vLLM {block.release}; {INSTALLED_VLLM} is installed")
    monkeypatch.setenv(CACHE_VARIABLE, str(shared_planners))
    for shown in block.shown():
        printed = run(shown.command, workspace, capsys)
        assert matches(shown.output, printed), (
            f"{block.name}: $ {shown.command}\n{difference(shown.output, printed)}"
        )


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


FIGURE = REPO / "docs" / "plan-h20.svg"


def test_the_figure_is_what_plan_draws(
    workspace: Workspace,
    shared_planners: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The README's figure is ``plan --gpu h20 --plot`` on vLLM 0.34.0 (the
    plans docs/plan.md shows: kept from its block where that ran first)."""
    if INSTALLED_VLLM != "0.34.0":
        pytest.skip(f"drawn on vLLM 0.34.0; {INSTALLED_VLLM} is installed")
    monkeypatch.setenv(CACHE_VARIABLE, str(shared_planners))
    drawn = workspace.headers.parent / "plan-h20.svg"
    run(f"vllm-kimi-k3-moe plan --gpu h20 --plot {drawn}", workspace, capsys)
    assert drawn.read_text() == FIGURE.read_text(), (
        "docs/plan-h20.svg: draw it again with "
        "vllm-kimi-k3-moe plan --gpu h20 --plot docs/plan-h20.svg"
    )
