"""Answers the tools worked out before, kept on disk: asking again is instant.

``plan`` builds vLLM's Kimi-K3 model on the meta device for each sharding it
sizes (importing vLLM alone takes 10-40 s). What it renders comes from
plain values (``plan.values``), so a question asked before is answered from
those values, kept here, without importing vLLM: the same rendering code
runs on the same values, and prints the same bytes.

A kept answer is used only where nothing that could change it changed. Its
key holds:

- the question itself (every validated input, as its ``repr``: the text
  config and quantization config read from ``--config``, the draft's config,
  the layouts, the serving options, the GPU budget);
- the installed vLLM (its version and the hash of its ``RECORD``, which lists
  the hash of every file pip installed), torch and transformers (versions),
  read from package metadata: none of them is imported;
- this plugin's own source (the hash of every file of the package);
- every ``VLLM_*`` environment variable the command was started with (vLLM
  reads its settings from them while it makes a config), except the
  logging ones, which change no number, and this module's own.

An editable vLLM whose source is changed in place without reinstalling keeps
its ``RECORD``: set ``VLLM_KIMI_K3_MOE_CACHE=off`` while working on vLLM.

Where: ``$VLLM_KIMI_K3_MOE_CACHE`` (a directory, or ``off``), else
``$XDG_CACHE_HOME/vllm-kimi-k3-moe/answers``, else
``~/.cache/vllm-kimi-k3-moe/answers``. An answer that cannot be read (another
Python, a truncated file) is worked out again; errors are never kept.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import vllm_kimi_k3_moe

CACHE_VARIABLE = "VLLM_KIMI_K3_MOE_CACHE"
OFF = "off"
# VLLM_* variables that change what vLLM logs, not what it builds
UNKEYED_PREFIXES = ("VLLM_LOGGING_", "VLLM_CONFIGURE_LOGGING", "VLLM_KIMI_K3_MOE")
# the distributions whose installed files decide the builds
DISTRIBUTIONS = ("vllm", "torch", "transformers")
# bumped when the kept values' meaning changes without a source change
LAYOUT = 1

T = TypeVar("T")


def cache_directory() -> Path | None:
    """Where answers are kept; None: not kept (``VLLM_KIMI_K3_MOE_CACHE=off``)."""
    given = os.environ.get(CACHE_VARIABLE)
    if given is not None:
        return None if given.strip().lower() == OFF else Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-kimi-k3-moe" / "answers"


@cache
def plugin_source_hash() -> str:
    """The hash of every file of this package (names and bytes), compiled
    bytecode aside: any change to the plugin or its tools is a new key."""
    root = Path(vllm_kimi_k3_moe.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _installed(distribution: str) -> str:
    """A distribution's version and the hash of its file list (``RECORD``)."""
    try:
        found = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return f"{distribution} not installed"
    record = (found.read_text("RECORD") or "").encode()
    return f"{distribution} {found.version} {hashlib.sha256(record).hexdigest()}"


@cache
def vllm_environment() -> dict[str, str]:
    """The ``VLLM_*`` variables that can change a build, as the command was
    started with them: read once, before anything is built, since vLLM sets
    some itself while it builds (0.33.0: ``VLLM_USE_BREAKABLE_CUDAGRAPH``),
    and the answers a command works out after its first build are asked
    again by a command that builds nothing."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith("VLLM_") and not name.startswith(UNKEYED_PREFIXES)
    }


def answer_key(question: Any) -> str:
    """The key of ``question``'s answer on this installation, as a file name."""
    parts = [
        f"layout {LAYOUT}",
        *(_installed(name) for name in DISTRIBUTIONS),
        f"plugin {plugin_source_hash()}",
        repr(vllm_environment()),
        repr(question),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def remembered(question: Any, work_out: Callable[[], T]) -> T:
    """The answer to ``question`` (anything whose ``repr`` names every input
    of ``work_out``): kept from before, or ``work_out()``'s, then kept. What
    ``work_out`` raises propagates and nothing is kept."""
    directory = cache_directory()
    if directory is None:
        return work_out()
    path = directory / f"{answer_key(question)}.pickle"
    try:
        with path.open("rb") as kept:
            return pickle.load(kept)
    except FileNotFoundError:
        pass
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        pass  # unreadable: worked out again and replaced
    answer = work_out()
    _keep(path, answer)
    return answer


def _keep(path: Path, answer: Any) -> None:
    """Write ``answer`` whole or not at all (a reader never sees half)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as kept:
            pickle.dump(answer, kept, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(kept.name, path)
    except OSError:
        pass  # a read-only or full disk: the answer is still printed
