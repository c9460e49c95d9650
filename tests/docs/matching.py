"""Output as the docs show it against output as a command prints it.

``...`` stands for what varies by run or machine: a line that is exactly
``...`` for any number of lines (none included), ``...`` within a line for
any text on that line. All else must be equal, trailing spaces aside."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

ELLIPSIS = "..."


def _pattern(shown: Sequence[str]) -> re.Pattern[str]:
    parts = []
    for line in shown:
        line = line.rstrip()
        if line == ELLIPSIS:
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append("[^\n]*?".join(map(re.escape, line.split(ELLIPSIS))) + "\n")
    return re.compile("".join(parts))


def matches(shown: Sequence[str], printed: str) -> bool:
    lines = [line.rstrip() for line in printed.splitlines()]
    text = "".join(f"{line}\n" for line in lines)
    return _pattern(shown).fullmatch(text) is not None


def difference(shown: Sequence[str], printed: str) -> str:
    """A unified diff, shown against printed, for a failure's message."""
    return "\n".join(
        difflib.unified_diff(
            [line.rstrip() for line in shown],
            [line.rstrip() for line in printed.splitlines()],
            "shown",
            "printed",
            lineterm="",
        )
    )
