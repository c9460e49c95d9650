"""What the in-place update tests share: the reload mode each update path
runs in."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def reload_mode(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Set ``VLLM_RELOAD_MODE`` as ``path`` (``updates.PATHS``) runs: vLLM
    0.34's direct mode for ``direct`` and load plans, else the layerwise
    default (0.33 reads no such variable)."""

    def set_mode(path: str) -> None:
        mode = "direct" if path in ("direct", "load_plan") else "layerwise"
        monkeypatch.setenv("VLLM_RELOAD_MODE", mode)

    return set_mode
