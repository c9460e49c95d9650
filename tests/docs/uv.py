"""uv, for the docs tests that run an install line the docs show (the
README's Test line, the Dockerfile's): the one the README's install put in
the venv (``pip install uv``), else the one on PATH, else the one ``.ci/run``
installs for the interpreter the venvs were made from."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def uv_command() -> list[str]:
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv"]
    on_path = shutil.which("uv")
    if on_path is not None:
        return [on_path]
    base = str(Path(sys.base_prefix) / "bin" / "python3")
    found = subprocess.run([base, "-m", "uv", "--version"], capture_output=True)
    if found.returncode == 0:
        return [base, "-m", "uv"]
    pytest.fail("no uv to run the docs' install lines with: pip install uv")
