"""Which fixes the plugin can turn on with the installed vLLM: every fix
judged, except those for code this release does not have. vLLM 0.33 has no
direct-mode reload and no load plans (``reload/direct.py`` and
``reload/plan.py`` arrived in 0.34), so those two fixes have nothing to patch
there. Written down per release, not worked out from the plugin."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable

# release -> {fix module's last name: the vLLM module it lacks}
NOTHING_TO_PATCH = {"0.33.0": {"direct": "reload.direct", "plan": "reload.plan"}}


def lacking() -> dict[str, str]:
    """The installed release's fixes with nothing to patch (drifted copies
    keep the installed release's code)."""
    return NOTHING_TO_PATCH.get(importlib.metadata.version("vllm"), {})


def fixes_on(fixes: Iterable[str]) -> list[str]:
    """``fixes`` (patch module names) without those the installed vLLM has
    no code for."""
    return [fix for fix in fixes if fix.rsplit(".", 1)[-1] not in lacking()]
