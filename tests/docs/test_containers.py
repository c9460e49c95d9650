"""docs/containers.md as a new user would follow it, where no image can be
built (this machine has no Docker engine):

- The Dockerfile's ``RUN`` steps run as written, in a venv that holds the
  installed vLLM as the image holds its own (the release its ``FROM`` tag
  names, else skipped): the wheel the page's ``uv build`` line makes from a
  copy of the checkout's tracked files, installed by the ``RUN`` line (its
  ``--system`` the venv's Python, its ``/tmp/`` the directory ``COPY``
  filled), then ``doctor``, which must say ON with the checkout's code.
  The venv is a new one whose ``.pth`` file puts this test's venv (vLLM,
  torch, all the image would hold) on its path: a few seconds, where a
  copy of a 10 GB venv would take minutes; ``doctor`` is most of it.
- Each ``docker run`` line's words after the image are a line ``plan``
  printed in the page (the docs test runs that command), after its
  ``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import REPO, Block, blocks
from tests.docs.uv import uv_command
from vllm_kimi_k3_moe.tools.cli.version import code_fingerprint

PAGE = Path("docs/containers.md")
IMAGE = "kimi-k3-vllm:0.34.0"  # what the page's docker build tags
INSTALLED_VLLM = importlib.metadata.version("vllm")


def page_blocks(language: str) -> list[Block]:
    return [block for block in blocks(PAGE) if block.language == language]


def joined(lines: tuple[str, ...]) -> list[str]:
    """Lines as a shell reads them: comments dropped, a trailing backslash
    continuing a line."""
    commands: list[str] = []
    continued = False
    for line in lines:
        if not continued and line.lstrip().startswith("#"):
            continue
        text = line.rstrip()
        if continued:
            commands[-1] += " " + text.rstrip("\\").strip()
        else:
            commands.append(text.rstrip("\\").strip())
        continued = text.endswith("\\")
    return commands


def dockerfile() -> tuple[str, list[str]]:
    """The Dockerfile's base image and its ``RUN`` commands."""
    (block,) = page_blocks("dockerfile")
    instructions = [line.split(" ", 1) for line in joined(block.lines)]
    base = next(rest for word, rest in instructions if word == "FROM")
    return base, [rest for word, rest in instructions if word == "RUN"]


def build_line() -> list[str]:
    """The page's ``uv build`` line."""
    (first, *_) = page_blocks("bash")
    line = next(c for c in joined(first.lines) if c.startswith("uv build "))
    return shlex.split(line)


def test_the_dockerfile_is_on_a_vllm_image_and_installs_the_plugin_alone() -> None:
    base, runs = dockerfile()
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", base), base
    install, check = runs
    assert install.startswith("uv pip install --system --no-deps /tmp/")
    assert check == "vllm-kimi-k3-moe doctor"


@pytest.mark.skipif(
    dockerfile()[0] != f"vllm/vllm-openai:v{INSTALLED_VLLM}",
    reason="the Dockerfile's image holds another vLLM release",
)
def test_the_dockerfiles_steps_install_the_wheel_and_doctor_says_on(
    tmp_path: Path,
) -> None:
    uv = uv_command()
    clone = tmp_path / "vllm-kimi-k3-moe"  # the tracked files, as a clone has
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in tracked:
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    words = build_line()
    out = Path(words[words.index("--out-dir") + 1])
    subprocess.run(
        [*uv, *words[1:-1], str(clone)], cwd=tmp_path, check=True, capture_output=True
    )
    venv = tmp_path / "image-python"
    subprocess.run([*uv, "venv", "--quiet", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "the_image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # uv here is this test's; the image's Python is the venv's; COPY's /tmp/
    # is the directory the wheel was written to
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "uv").write_text(f'#!/bin/sh\nexec {shlex.join(uv)} "$@"\n')
    (shim / "uv").chmod(0o755)
    environment = {**os.environ, "PATH": f"{shim}:{venv / 'bin'}:{os.environ['PATH']}"}
    install, check = dockerfile()[1]
    install = install.replace("/tmp/", f"{tmp_path / out}/")
    install = install.replace("--system", f"--python {python}")
    subprocess.run(["sh", "-c", install], env=environment, check=True)
    installed = {p.name for p in Path(site).iterdir()} - {"the_image.pth"}
    assert "vllm_kimi_k3_moe" in installed  # the wheel's, first on the path
    assert {n for n in installed if not n.startswith("vllm_kimi_k3_moe")} == set()
    said = subprocess.run(
        ["sh", "-c", check], env=environment, capture_output=True, text=True
    )
    assert said.returncode == 0, said.stdout + said.stderr
    assert said.stdout.splitlines()[-1].startswith("ON "), said.stdout
    assert f"code         {code_fingerprint()} " in said.stdout  # this checkout's
    assert f"vLLM         {INSTALLED_VLLM} installed" in said.stdout  # kept


def test_each_container_runs_a_line_plan_printed() -> None:
    (console,) = page_blocks("console")
    printed = {line for shown in console.shown() for line in shown.output}
    containers = [
        command
        for block in page_blocks("bash")
        for command in joined(block.lines)
        if command.startswith("docker run -d ")
    ]
    assert len(containers) == 2  # node 0's, and node 1's for the others
    for command in containers:
        words = shlex.split(command)
        served = shlex.join(["vllm", "serve", *words[words.index(IMAGE) + 1 :]])
        assert served in printed, served
