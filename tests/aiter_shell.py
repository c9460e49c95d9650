"""A shell without AITER's SiTUv2 variables, for commands tests run or start.

vLLM's AITER module sets ``AITER_SITUV2_A4W4`` or ``AITER_SITUV2_A8W4`` in
the environment of the process that imports it (as in every vLLM process),
and a test process imports it sooner or later. A command a test runs is an
operator's, started from a shell without them; ``check`` reads them from
its environment (``tools.check.aiter_environment``), and would import vLLM
to say what vLLM makes of them."""

from __future__ import annotations

import os

import pytest

AITER_SITUV2 = "AITER_SITUV2_"


def without_aiters_situv2(patch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(AITER_SITUV2)]:
        patch.delenv(name)
