"""The problems ``check`` finds, grouped as they are found.

A release-sized checkpoint with one fault can have hundreds of thousands of
problems (a lost ``quantization_config``: every expert tensor missing and
every stored one unexpected). They are kept by kind, and counted per kind
and per shard as each one is added, so that the report can summarise them
without another pass over the tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import msgspec

# In the order the report lists them: a broken shard explains the rest.
KINDS = ("shard", "missing", "shape", "dtype", "duplicate", "unexpected")
NO_SHARD = "in no shard"  # a missing tensor the index does not place


class Problem(msgspec.Struct, frozen=True, gc=False):
    """One thing that would break or corrupt loading, about one subject (a
    tensor or a shard), and the shard it is in (for a missing tensor: the
    shard the index puts it in; None: none)."""

    kind: str
    subject: str
    detail: str
    shard: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.subject}: {self.detail}"


class ProblemLog:
    """Every problem, by kind, with counts per kind and per shard."""

    def __init__(self) -> None:
        self.by_kind: dict[str, list[Problem]] = {kind: [] for kind in KINDS}
        # shard (or NO_SHARD) -> kind -> problems
        self.by_shard: dict[str, Counter[str]] = {}

    def add(self, kind: str, subject: str, detail: str, shard: str | None) -> None:
        self.by_kind[kind].append(Problem(kind, subject, detail, shard))
        counts = self.by_shard.get(shard or NO_SHARD)
        if counts is None:
            counts = self.by_shard[shard or NO_SHARD] = Counter()
        counts[kind] += 1

    def __len__(self) -> int:
        return sum(map(len, self.by_kind.values()))

    def __bool__(self) -> bool:
        return any(self.by_kind.values())

    def __iter__(self) -> Iterator[Problem]:
        for problems in self.by_kind.values():
            yield from problems

    def counts(self) -> dict[str, int]:
        """Problems per kind, for the kinds found, in ``KINDS`` order."""
        return {kind: len(found) for kind, found in self.by_kind.items() if found}

    def shards_by_count(self) -> list[tuple[str, Counter[str]]]:
        """(shard, problems per kind) for each shard with problems, most
        problems first (a broken shard first of all)."""
        return sorted(
            self.by_shard.items(),
            key=lambda item: (-item[1]["shard"], -item[1].total(), item[0]),
        )
