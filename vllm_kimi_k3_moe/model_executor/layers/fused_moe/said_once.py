"""The plugin's layer lines, each said once per process: every layer of a
model (92 MoE layers, the draft's too) would repeat them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("vllm.plugins.kimi_k3_moe")
_said: set[str] = set()


def say_once(line: str) -> None:
    """Log ``line`` unless this process said it already."""
    if line not in _said:
        _said.add(line)
        logger.info(line)


@contextmanager
def forgotten_after() -> Iterator[None]:
    """What is said in the block is not remembered after it (a layer built
    to try something, whose lines are not what the model's layers do)."""
    said = set(_said)
    try:
        yield
    finally:
        _said.intersection_update(said)
