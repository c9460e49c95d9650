"""Commands run in one test share their planners: a ``Planner`` is made once
per set of arguments (``plan`` makes its own in ``answers``, ``check`` in
``planner.plan_deployment``) and closed at the end, where a command closes the
one it made (kept open), so a plan several commands ask for is built once, as
the suite's planner fixtures share theirs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_kimi_k3_moe.tools.plan import answers, planner


@contextlib.contextmanager
def shared_planners(patch: pytest.MonkeyPatch) -> Iterator[None]:
    made: dict[str, Any] = {}
    real = planner.Planner

    class Kept(real):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            """Kept open for the next command."""

    def shared(*args: Any, **kwargs: Any) -> Any:
        key = repr((args, sorted(kwargs.items())))
        if key not in made:
            made[key] = Kept(*args, **kwargs)
        return made[key]

    patch.setattr(answers, "Planner", shared)
    patch.setattr(planner, "Planner", shared)
    try:
        yield
    finally:
        for kept in made.values():
            real.close(kept)
