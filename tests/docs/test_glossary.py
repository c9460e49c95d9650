"""docs/glossary.md holds every term the README and ``plan``'s answers use,
and the README links it before its first term.

A term is a word of capitals (TP32, MXFP4, AITER, DCP16, ROCm, ...) in the
README's prose, in the output the README shows, and in the output any page
shows of a ``plan`` command; a layout's size (TP32 is TP) and a plural
``s`` are not part of it. GPU product names and what a vLLM user deploying
Kimi-K3 knows (``COMMON``) are not terms. The glossary defines a term where
it is a word of one of its bold headwords."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import REPO, blocks, markdown_files

TERM = re.compile(r"\b[A-Z][A-Z0-9]+[a-z]?\b")
HEADWORD = re.compile(r"^- \*\*(.+?)\*\*", re.MULTILINE)
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# product names: MI300X, H20, B200, GB300; Kimi-K3's K3
PRODUCT = re.compile(r"^(?:MI\d{3}X|[HB]\d+|GB\d+|K3)$")
# known to anyone running vLLM on GPUs, or the docs' placeholders
COMMON = {
    "AMD", "NVIDIA", "CPU", "GPU", "CUDA", "NCCL", "CI", "OK", "ON", "OFF",
    "SHA", "MB", "TB", "CHANGELOG", "NAME", "FILE", "DIR", "PATH", "X", "N",
}  # fmt: skip
# named as undefined by issue 67, besides the capitals
NAMED = ["expert parallelism", "pad", "Marlin", "header set", "meta device"]


def glossary() -> str:
    return (REPO / "docs" / "glossary.md").read_text()


def headwords() -> set[str]:
    words: set[str] = set()
    for heads in HEADWORD.findall(glossary()):
        words |= set(re.split(r"[\s,()]+", heads)) - {""}
    return words


def readme_prose() -> str:
    return FENCED.sub("", (REPO / "README.md").read_text())


def terms_used() -> set[str]:
    """The README's terms and those of the output any page shows of plan."""
    shown = [readme_prose()]
    for page in markdown_files():
        for block in blocks(page):
            if block.language != "console":
                continue
            for command in block.shown():
                if page == Path("README.md") or " plan " in f"{command.command} ":
                    shown += command.output
    return {word for text in shown for word in TERM.findall(text)}


def defined(term: str, words: set[str]) -> bool:
    bare = term.removesuffix("s")
    return any(t in words for t in (term, bare, bare.rstrip("0123456789")))


def test_every_term_of_the_readme_and_plans_answers_is_in_the_glossary() -> None:
    words = headwords()
    missing = {
        term
        for term in terms_used()
        if not PRODUCT.match(term.removesuffix("s"))
        and term.removesuffix("s") not in COMMON
        and not defined(term, words)
    }
    assert not missing, f"not in docs/glossary.md: {sorted(missing)}"


def test_a_term_without_an_entry_is_found() -> None:
    assert not defined("FOO8", headwords())
    assert defined("TP32", headwords()) and defined("CDNA4", headwords())


@pytest.mark.parametrize("term", NAMED)
def test_the_terms_the_readme_used_undefined_are_defined(term: str) -> None:
    assert term.lower() in glossary().lower()


def test_the_readme_links_the_glossary_before_its_first_term() -> None:
    prose, words = readme_prose(), headwords()
    first = min(m.start() for m in TERM.finditer(prose) if defined(m.group(), words))
    assert prose.index("](docs/glossary.md") < first
