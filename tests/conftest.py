"""Every test keeps ``plan``'s answers in a directory of its own
(``tools.deployment.remembered``): no test reads an answer another test, or the
operator's own runs, kept, and none writes to the user's cache. Each test
is a command of its own: the VLLM_* settings are read afresh."""

from __future__ import annotations

import pytest

from vllm_kimi_k3_moe.tools.deployment.remembered import (
    CACHE_VARIABLE,
    vllm_environment,
)


@pytest.fixture(autouse=True)
def answers_kept_per_test(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path_factory.mktemp("answers")))
    vllm_environment.cache_clear()
