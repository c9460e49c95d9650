"""The fenced code blocks of the repository's Markdown (the README and
``docs/*.md``), and in each ``console`` block the commands it shows (lines
starting ``$ ``, continued by a trailing backslash) with the output shown
under each.

A block preceded by ``<!-- vLLM X.Y.Z -->`` shows what that release prints:
it is compared only where that release is installed (CI runs both)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\S*)\s*$")
RELEASE_MARK = re.compile(r"^<!-- vLLM (\d+\.\d+\.\d+) -->$")
PROMPT = "$ "


@dataclass(frozen=True)
class Shown:
    """One command of a ``console`` block and the output shown under it."""

    command: str  # continuation lines joined, without the prompt
    output: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    path: Path  # relative to the repository
    line: int  # of the opening fence, 1-based
    language: str
    lines: tuple[str, ...]
    release: str | None  # the vLLM release it shows, where marked

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"

    def shown(self) -> list[Shown]:
        """The commands of a ``console`` block, each with its output."""
        found: list[Shown] = []
        lines = list(self.lines)
        while lines:
            line = lines.pop(0)
            if not line.startswith(PROMPT):
                raise ValueError(f"{self.name}: output before any command: {line!r}")
            command = line[len(PROMPT) :]
            while command.endswith("\\") and lines:
                command = command[:-1].rstrip() + " " + lines.pop(0).strip()
            output = []
            while lines and not lines[0].startswith(PROMPT):
                output.append(lines.pop(0))
            found.append(Shown(command, tuple(output)))
        return found


def markdown_files() -> list[Path]:
    """The README and every page under ``docs/``, relative to the repo."""
    pages = sorted((REPO / "docs").glob("*.md"))
    return [Path("README.md"), *(page.relative_to(REPO) for page in pages)]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file."""
    found: list[Block] = []
    text = (REPO / path).read_text().splitlines()
    index = 0
    while index < len(text):
        opening = FENCE.match(text[index])
        if not opening:
            index += 1
            continue
        end = index + 1
        while not text[end].startswith("```"):
            end += 1
        before = text[index - 1] if index else ""
        mark = RELEASE_MARK.match(before)
        found.append(
            Block(
                path=path,
                line=index + 1,
                language=opening.group(1),
                lines=tuple(text[index + 1 : end]),
                release=mark.group(1) if mark else None,
            )
        )
        index = end + 1
    return found


def every_block() -> list[Block]:
    return [block for path in markdown_files() for block in blocks(path)]
