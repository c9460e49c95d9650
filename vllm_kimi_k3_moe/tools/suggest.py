"""A misspelt command, choice or option answered with the closest right one
(Python 3.12's argparse does so with ``suggest_on_error``; the tools run on
3.10 and 3.11 too)."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence

# argparse's words for a value outside an argument's choices
INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")
QUOTED = re.compile(r"'([^']*)'")


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``word`` most likely misspells, if one is close."""
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def with_choice_suggested(message: str) -> str:
    """argparse's invalid-choice message, with the closest choice named."""
    invalid = INVALID_CHOICE.search(message)
    if not invalid:
        return message
    suggestion = closest(invalid.group(1), QUOTED.findall(invalid.group(2)))
    return f"{message}; did you mean '{suggestion}'?" if suggestion else message


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The long options ``parser`` takes (``--help`` aside)."""
    return [
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]


def unrecognized(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments ``parser`` does not take, each misspelt option
    followed by the option it most likely means."""
    said = []
    for extra in extras:
        name = extra.partition("=")[0]
        suggestion = (
            closest(name, option_strings(parser)) if name.startswith("-") else None
        )
        said.append(f"{extra} (did you mean {suggestion}?)" if suggestion else extra)
    return f"unrecognized arguments: {' '.join(said)}"
