"""The docs point only inside the repository: every relative link of the
README, CHANGELOG and docs/*.md names a file of the checkout (and, with
``#anchor``, one of its headings, as GitHub makes anchors of them), and no
tracked file names a path of the machine it was written on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import REPO, markdown_files

LINK = re.compile(r"\]\(([^)\s]+)\)")
EXTERNAL = ("http://", "https://", "mailto:")
HEADING = re.compile(r"^#{1,6} (.+)$")
# where this project's machines keep what is not part of the repository
OUTSIDE = re.compile(r"\.\./shared/|\bshared[/]reference/|/work/(?:main|shared)\b")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := HEADING.match(line)):
            found.add(anchor(heading.group(1)))
    return found


PAGES = [*markdown_files(), Path("CHANGELOG.md")]


@pytest.mark.parametrize("page", PAGES, ids=str)
def test_every_link_resolves_inside_the_repository(page: Path) -> None:
    source = REPO / page
    for target in LINK.findall(source.read_text()):
        if target.startswith(EXTERNAL):
            continue
        path, _, fragment = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.is_relative_to(REPO), f"{page}: {target} leaves the repository"
        assert linked.exists(), f"{page}: {target} names no file"
        if fragment:
            assert fragment in anchors(linked), f"{page}: {target}: no such heading"


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    named = []
    for name in tracked:
        try:
            text = (REPO / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        named += [f"{name}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not named, named


def test_the_github_anchors_of_a_few_headings() -> None:
    assert anchor("`plan`: which layout fits your GPUs") == (
        "plan-which-layout-fits-your-gpus"
    )
    assert anchor("The in-tree form: `upstream/vllm-{release}.patch`") == (
        "the-in-tree-form-upstreamvllm-releasepatch"
    )
