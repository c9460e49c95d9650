"""How shown output is compared with printed output (``matching``): ``...``
for what varies, all else equal; a serve line turned back to a
``--gpu-memory-utilization`` that ``plan`` does not print fails."""

from __future__ import annotations

from tests.docs.markdown_blocks import Block, every_block
from tests.docs.matching import ELLIPSIS, difference, matches


def test_a_line_of_dots_stands_for_any_lines() -> None:
    assert matches(["a", ELLIPSIS, "d"], "a\nb\nc\nd\n")
    assert matches(["a", ELLIPSIS, "d"], "a\nd\n")
    assert not matches(["a", ELLIPSIS, "d"], "a\nb\n")


def test_dots_within_a_line_stand_for_any_text_on_it() -> None:
    assert matches(["code  ... (SHA-256)"], "code  0f8987e24a98 (SHA-256)")
    assert not matches(["code  ... (SHA-256)"], "code  0f89\n(SHA-256)")
    assert not matches(["error ... at 1"], "error 2.0e-07 at 16")


def test_trailing_spaces_aside_everything_else_counts() -> None:
    assert matches(["a  "], "a")
    assert not matches(["a"], "a\nb")
    assert "+b" in difference(["a"], "a\nb")


def readme_plan_block() -> Block:
    (block,) = [
        b
        for b in every_block()
        if str(b.path) == "README.md"
        and b.language == "console"
        and b.lines[0].startswith("$ vllm-kimi-k3-moe plan --gpu h20")
    ]
    return block


def test_the_readme_serve_line_turned_back_to_092_fails() -> None:
    """What the issue found: a README serve line with a memory share that
    ``plan`` never printed. The block's output, its ``...`` dropped, stands
    for what ``plan`` prints (the docs test runs it)."""
    (shown,) = readme_plan_block().shown()
    printed = "\n".join(line for line in shown.output if line != ELLIPSIS)
    assert matches(shown.output, printed)
    edited = [
        line.replace(
            "--max-model-len 131072 \\",
            "--max-model-len 131072 --gpu-memory-utilization 0.92 \\",
        )
        for line in shown.output
    ]
    assert edited != list(shown.output)
    assert not matches(edited, printed)
