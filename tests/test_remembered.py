"""``tools.deployment.remembered``: a kept answer is used only where nothing that could
change it changed (the question, the installed vLLM, the plugin's source, a
``VLLM_*`` setting), never where it did."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.tools.deployment import remembered as kept
from vllm_kimi_k3_moe.tools.deployment.remembered import CACHE_VARIABLE, remembered


class Counted:
    """A ``work_out`` that counts how often it is run."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self) -> dict[str, int]:
        self.runs += 1
        return {"tokens": 410071}


def _another_vllm(monkeypatch, tmp_path: Path) -> None:
    """A vLLM distribution of another version first on ``sys.path``: what
    ``importlib.metadata`` then reads as the installed vLLM."""
    info = tmp_path / "site" / "vllm-9.9.9.dist-info"
    info.mkdir(parents=True)
    metadata = "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n"
    (info / "METADATA").write_text(metadata)
    (info / "RECORD").write_text("vllm/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def _another_plugin_source(monkeypatch, tmp_path: Path) -> None:
    """The plugin's package with one file changed."""
    root = Path(vllm_kimi_k3_moe.__file__).parent
    copy = tmp_path / "vllm_kimi_k3_moe"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "formats" / "__init__.py").open("a") as changed:
        changed.write("# changed\n")
    monkeypatch.setattr(vllm_kimi_k3_moe, "__file__", str(copy / "__init__.py"))
    kept.plugin_source_hash.cache_clear()


CHANGES = {
    "the question": lambda mp, tmp: None,  # asked below with another question
    "vLLM's version": _another_vllm,
    "the plugin's source": _another_plugin_source,
    "a VLLM_ setting": lambda mp, tmp: _another_setting(mp, "VLLM_USE_DEEP_GEMM"),
}


def _another_setting(monkeypatch, name: str) -> None:
    """Another command, started with ``name`` set."""
    monkeypatch.setenv(name, "0")
    kept.vllm_environment.cache_clear()


@pytest.fixture(autouse=True)
def read_afresh():
    """The source hash and the VLLM_* settings are read once per command;
    each test is a command of its own."""
    for read in (kept.plugin_source_hash, kept.vllm_environment):
        read.cache_clear()
    yield
    for read in (kept.plugin_source_hash, kept.vllm_environment):
        read.cache_clear()


def test_asked_again_the_kept_answer_is_returned(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    work = Counted()
    first = remembered(("plan", 32, "h20"), work)
    again = remembered(("plan", 32, "h20"), work)
    assert work.runs == 1
    assert again == first
    # logging settings change no answer
    _another_setting(monkeypatch, "VLLM_LOGGING_LEVEL")
    remembered(("plan", 32, "h20"), work)
    assert work.runs == 1


def test_what_vllm_sets_while_it_builds_changes_no_key(tmp_path, monkeypatch):
    """vLLM sets VLLM_* variables itself as it makes a config: an answer
    worked out after a build is found by a command that builds nothing."""
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    # as a command starts: not set yet (a build earlier in this test process
    # may have set it, as vLLM 0.33.0 does)
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    kept.vllm_environment.cache_clear()
    work = Counted()
    remembered("first", work)  # this command's settings read here
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")  # as vLLM does
    remembered("after the build", work)
    kept.vllm_environment.cache_clear()  # a new command, without it
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    remembered("after the build", work)
    assert work.runs == 2


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_any_change_works_the_answer_out_again(tmp_path, monkeypatch, change):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "kept"))
    work = Counted()
    remembered(("plan", 32, "h20"), work)
    change(monkeypatch, tmp_path)
    question = ("plan", 16, "h20") if change is CHANGES["the question"] else None
    remembered(question or ("plan", 32, "h20"), work)
    assert work.runs == 2


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, "off")
    work = Counted()
    remembered("q", work)
    remembered("q", work)
    assert work.runs == 2


def test_errors_are_not_kept_and_an_unreadable_answer_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))

    def refused() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        remembered("q", refused)
    assert list(tmp_path.iterdir()) == []
    work = Counted()
    remembered("q", work)
    (answer,) = tmp_path.iterdir()
    answer.write_bytes(b"truncat")
    assert remembered("q", work) == {"tokens": 410071}
    assert work.runs == 2
