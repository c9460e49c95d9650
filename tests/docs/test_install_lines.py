"""The README's Test block, run in the venv its Install made, keeps that
venv's vLLM 0.34.0: its first line, given to uv with ``--dry-run`` in this
test's venv (vLLM 0.34.0 in CI's 0.34 run), would change neither vLLM nor
the flashinfer vLLM pins (pip's line there would put vLLM 0.33.0 in its
place, which the README says on the line that gives it)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import REPO, blocks
from tests.docs.uv import uv_command

INSTALL_RELEASE = "0.34.0"  # what the README's Install puts in a new venv
# a line of uv's plan: " - name==version" removed, " + name==version" added
CHANGE = re.compile(r"^ [-+] ([\w.-]+)")


def readme_test_lines() -> list[list[str]]:
    """The words of each command of the README's Test block, comments
    dropped."""
    readme = Path("README.md")
    text = (REPO / readme).read_text()
    heading = text[: text.index("## Test\n")].count("\n") + 1
    block = next(b for b in blocks(readme) if b.line > heading)
    return [shlex.split(command, comments=True) for command in block.lines]


def test_the_first_test_line_is_uvs_with_the_override_installs_line() -> None:
    first = readme_test_lines()[0]
    assert first[:3] == ["uv", "pip", "install"]
    assert "--override" in first and first[-1] == ".[test]"


@pytest.mark.skipif(
    importlib.metadata.version("vllm") != INSTALL_RELEASE,
    reason=f"the README's Install puts vLLM {INSTALL_RELEASE} in its venv",
)
def test_the_first_test_line_keeps_the_installs_vllm() -> None:
    first = readme_test_lines()[0]
    dry_run = ["pip", "install", "--dry-run", "--python", sys.executable]
    planned = subprocess.run(
        [*uv_command(), *dry_run, *first[3:]],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert planned.returncode == 0, planned.stderr
    changed = {
        m.group(1) for line in planned.stderr.splitlines() if (m := CHANGE.match(line))
    }
    assert "vllm-kimi-k3-moe" in changed, planned.stderr  # it planned the install
    assert not changed & {"vllm", "flashinfer-python"}, planned.stderr
