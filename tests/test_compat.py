"""The verified vLLM releases are named once (``compat``): the package's
requirement admits them and every later release (never replacing an
operator's newer vLLM), and every message derives from them."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from vllm_kimi_k3_moe import compat

REPO = Path(__file__).parents[1]


def vllm_requirement() -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (vllm,) = [
        Requirement(d) for d in project["dependencies"] if Requirement(d).name == "vllm"
    ]
    return vllm


def test_the_vllm_requirement_admits_the_verified_and_later_releases() -> None:
    """pip or uv never replaces a newer vLLM, and a fresh venv gets the
    newest that installs: the runtime decides (``verification``)."""
    specifier = vllm_requirement().specifier
    series = compat.SUPPORTED_VLLM_SERIES
    assert series == ((0, 33), (0, 34))
    for release in compat.VERIFIED_VLLM_RELEASES:
        assert release in specifier
    for major, minor in series:
        assert f"{major}.{minor}.9" in specifier  # a later patch release
    (first_major, first_minor), (last_major, last_minor) = series[0], series[-1]
    assert f"{first_major}.{first_minor - 1}.9" not in specifier
    for later in (f"{last_major}.{last_minor + 1}.0", "0.40.2", "1.0.0"):
        assert later in specifier
    nightly = f"{last_major}.{last_minor}.1.dev57+gdeadbee"
    assert specifier.contains(nightly, prereleases=True)
    assert compat.supported_vllm_series() == "0.33.x or 0.34.x"


def test_messages_name_the_installed_release() -> None:
    from importlib.metadata import version

    assert version("vllm") in compat.VERIFIED_VLLM_RELEASES  # what CI installs
    assert f"vLLM {version('vllm')}" == compat.VLLM


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
            ):
                found.add(id(body[0].value))
    return found


def test_messages_name_the_release_through_compat() -> None:
    """No string the package prints spells a release: a bump edits
    ``compat`` alone (docstrings and comments describe facts of a release)."""
    spelt = []
    for module in (REPO / "vllm_kimi_k3_moe").rglob("*.py"):
        # compat names the releases; verified_code records each one's code
        if module.name in ("compat.py", "verified_code.py"):
            continue
        tree = ast.parse(module.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and any(r in node.value for r in compat.VERIFIED_VLLM_RELEASES)
            ):
                spelt.append(f"{module.relative_to(REPO)}:{node.lineno}")
    assert spelt == []
