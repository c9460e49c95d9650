"""Post-import hooks: a list of callbacks per module, run after each execution,
the module's real loader put back, and removable."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys

import pytest

from vllm_kimi_k3_moe.import_hooks import (
    call_after_import,
    remove_after_import,
    watched_modules,
)

PROBE = "kimi_k3_hook_probe"


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """A module nobody has imported yet; forgotten afterwards."""
    (tmp_path / f"{PROBE}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PROBE
    sys.modules.pop(PROBE, None)


def test_callbacks_run_in_order_once_each_after_every_execution(probe_module):
    seen = []

    def first(module):
        seen.append(("first", module.VALUE))

    def second(module):
        seen.append(("second", module.VALUE))

    try:
        call_after_import(probe_module, first)
        call_after_import(probe_module, second)
        call_after_import(probe_module, first)  # already there: still once
        assert probe_module in watched_modules()
        module = importlib.import_module(probe_module)
        assert seen == [("first", 1), ("second", 1)]

        # The module keeps its real loader, so a reload is not wrapped twice.
        assert type(module.__spec__.loader) is importlib.machinery.SourceFileLoader
        assert module.__loader__ is module.__spec__.loader
        importlib.reload(module)
        assert seen == [("first", 1), ("second", 1)] * 2

        remove_after_import(probe_module, first)
        importlib.reload(module)
        assert seen[-1] == ("second", 1) and len(seen) == 5
    finally:
        remove_after_import(probe_module, first)
        remove_after_import(probe_module, second)
    assert probe_module not in watched_modules()


def test_callback_added_after_import_runs_at_once(probe_module):
    module = importlib.import_module(probe_module)
    seen = []
    try:
        call_after_import(probe_module, seen.append)
        assert seen == [module]
        call_after_import(probe_module, seen.append)  # the same one again
        assert seen == [module]
    finally:
        remove_after_import(probe_module, seen.append)
