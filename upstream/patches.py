"""Which in-tree patch is made for which vLLM release.

Each patch sits beside this module as ``vllm-{release}.patch``, named for the
vLLM release whose files its hunks were made against (``git apply --check``
refuses it on any other). ``patch_for`` finds the one for a release, or
raises ``NoPatchForRelease`` with a one-line message naming what there is.
"""

from __future__ import annotations

import re
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
_NAME = re.compile(r"vllm-(\d+(?:\.\d+)*)\.patch")


class NoPatchForRelease(Exception):
    """No patch here was made for this vLLM release; nothing was written."""


def release_of(patch: Path) -> str | None:
    """The vLLM release ``patch`` was made for, as its name says (``None``:
    a name that says none)."""
    match = _NAME.fullmatch(patch.name)
    return match.group(1) if match else None


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(n) for n in release.split("."))


def patch_releases() -> list[str]:
    """Every release a patch here is made for, oldest first."""
    found = (release_of(p) for p in DIRECTORY.glob("vllm-*.patch"))
    return sorted((r for r in found if r is not None), key=_release_key)


def patch_for(release: str) -> Path:
    """The patch made for vLLM ``release``."""
    patch = DIRECTORY / f"vllm-{release}.patch"
    if not patch.is_file():
        made = ", ".join(f"vllm-{r}.patch" for r in patch_releases()) or "none"
        raise NoPatchForRelease(
            f"no in-tree patch for vLLM {release} ({DIRECTORY} has {made}); "
            "nothing was changed"
        )
    return patch
