"""The supported vLLM is named once (``compat``): the package's requirement
admits exactly that series, and every message derives from it."""

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


def test_the_vllm_requirement_admits_exactly_the_supported_series() -> None:
    major, minor = compat.SUPPORTED_VLLM_SERIES
    specifier = vllm_requirement().specifier
    assert compat.TESTED_VLLM_RELEASE in specifier
    assert f"{major}.{minor}.9" in specifier  # a later patch release
    assert f"{major}.{minor + 1}.0" not in specifier
    assert f"{major}.{minor - 1}.9" not in specifier
    assert compat.supported_vllm_series() == f"{major}.{minor}.x"


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


def test_messages_name_the_tested_release_through_compat() -> None:
    """No string the package prints spells the release: a bump edits
    ``compat`` alone (docstrings and comments describe facts of a release)."""
    assert f"vLLM {compat.TESTED_VLLM_RELEASE}" == compat.VLLM
    spelt = []
    for module in (REPO / "vllm_kimi_k3_moe").rglob("*.py"):
        if module.name == "compat.py":
            continue
        tree = ast.parse(module.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and compat.TESTED_VLLM_RELEASE in node.value
            ):
                spelt.append(f"{module.relative_to(REPO)}:{node.lineno}")
    assert spelt == []
