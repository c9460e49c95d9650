"""What the in-place update tests share: the reload mode each update path
runs in."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.models.kimi_k3.preparation.updates import reload_mode_of


@pytest.fixture
def reload_mode(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Set ``VLLM_RELOAD_MODE`` as ``path`` (``updates.PATHS``) runs it
    (0.33 reads no such variable)."""

    def set_mode(path: str) -> None:
        monkeypatch.setenv("VLLM_RELOAD_MODE", reload_mode_of(path))

    return set_mode
