"""Releases users can tell apart: the version in ``pyproject.toml`` is the
changelog's newest, which names the vLLM series the plugin supports; the
code fingerprint ``doctor`` prints follows the package's source and nothing
else."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import tomllib

from vllm_kimi_k3_moe.compat import supported_vllm_series
from vllm_kimi_k3_moe.tools.cli.version import PACKAGE_ROOT, code_fingerprint

REPO = Path(__file__).parents[1]


def newest_changelog_entry() -> tuple[str, str]:
    """(version, text) of ``CHANGELOG.md``'s first ``## `` section."""
    text = (REPO / "CHANGELOG.md").read_text()
    found = re.search(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, "CHANGELOG.md has no version section"
    return found.group(1), found.group(2)


def test_the_version_is_the_changelogs_newest() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    version, _ = newest_changelog_entry()
    assert project["version"] == version
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), "semantic: MAJOR.MINOR.PATCH"


def test_the_newest_entry_names_the_supported_vllm_releases() -> None:
    _, text = newest_changelog_entry()
    # compat says "0.33.x or 0.34.x": each series is named in the entry
    for series in re.findall(r"\d+\.\d+\.x", supported_vllm_series()):
        assert series in text


def copy_of_the_package(directory: Path) -> Path:
    copy = directory / "vllm_kimi_k3_moe"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_fingerprint_is_the_sources_wherever_it_is_installed(tmp_path) -> None:
    """Elsewhere, with bytecode and other files beside it, the same code has
    the same fingerprint: twelve hex digits."""
    copy = copy_of_the_package(tmp_path)
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "compat.cpython-311.pyc").write_bytes(b"\x00bytecode")
    (copy / "notes.txt").write_text("not code")
    assert code_fingerprint(copy) == code_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{12}", code_fingerprint())


def test_one_byte_or_one_name_changed_is_another_fingerprint(tmp_path) -> None:
    copy = copy_of_the_package(tmp_path)
    module = copy / "compat.py"
    source = module.read_bytes()
    module.write_bytes(source + b"\n")
    edited = code_fingerprint(copy)
    module.write_bytes(source)
    assert code_fingerprint(copy) == code_fingerprint() != edited
    module.rename(copy / "compat_renamed.py")
    assert code_fingerprint(copy) not in (code_fingerprint(), edited)
