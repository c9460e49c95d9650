"""Every test keeps ``plan``'s answers in a directory of its own
(``tools.deployment.remembered``): no test reads an answer another test, or the
operator's own runs, kept, and none writes to the user's cache. Each test
is a command of its own: the VLLM_* settings are read afresh.

The tests marked ``slow`` (a minute or more each on CI's 2 cores) run first:
one of them started last would leave the other workers idle until it ends.
pytest-xdist's worksteal (``pyproject.toml``) gives each worker an equal
share in collection order, all of these in the first worker's, and a worker
done with its share takes half of what another has not started."""

from __future__ import annotations

import os

import pytest

from tests.aiter_shell import without_aiters_situv2
from vllm_kimi_k3_moe.tools.deployment.remembered import (
    CACHE_VARIABLE,
    vllm_environment,
)

# One torch thread per process: pytest-xdist runs one worker per core (the
# README's -n auto), and tests start child processes besides; torch's own
# pool of one thread per core (its OpenMP threads spin while they wait)
# oversubscribed the CPU. vLLM 0.34.0's suite on 2 cores took 800 to 890 s
# with it and 702 s without. Set before any test module imports torch (this
# file is loaded first); child processes inherit it. Results do not depend
# on it: the forward tests compare within a tolerance, and a bit-for-bit
# comparison runs both sides under the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def answers_kept_per_test(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path_factory.mktemp("answers")))
    vllm_environment.cache_clear()


@pytest.fixture(autouse=True)
def a_shell_without_aiters_situv2(monkeypatch):
    """What an earlier test's import of vLLM set is not the next command's."""
    without_aiters_situv2(monkeypatch)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first, in collection order; the rest as collected
    (and as pytest grouped them by fixture)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
