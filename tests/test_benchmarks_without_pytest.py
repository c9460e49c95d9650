"""The RL guide's examples, ``python -m benchmarks.weight_update`` and
``benchmarks.in_place_updates``, run in the
venv the README's install makes, which has no pytest: nothing it imports from
the checkout (``benchmarks``, the test helpers it builds from) imports pytest
at module level. Read from the source: every module-level import, followed
through the checkout's own modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).parents[1]
LOCAL = ("benchmarks", "tests")  # the checkout's packages a benchmark reaches


def _path(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_level_imports(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def pytest_importers(start: str) -> list[str]:
    """The checkout's modules reached from ``start`` that import pytest."""
    seen, todo, found = set(), [start], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _path(module)
        if path is None:
            continue
        parents = module.split(".")
        todo += [".".join(parents[:i]) for i in range(1, len(parents))]
        for name in _module_level_imports(path):
            if name.split(".")[0] in ("pytest", "_pytest"):
                found.append(module)
            elif name.split(".")[0] in LOCAL:
                todo.append(name)
    return sorted(set(found))


def test_the_rl_guide_examples_need_no_pytest() -> None:
    for example in ("benchmarks.weight_update", "benchmarks.in_place_updates"):
        assert pytest_importers(example) == [], example


def test_the_check_finds_a_pytest_import() -> None:
    """What the test above would say if a module it reaches imported pytest
    (the test suite's conftest does)."""
    assert "tests.models.kimi_k3.conftest" in pytest_importers(
        "tests.models.kimi_k3.conftest"
    )
