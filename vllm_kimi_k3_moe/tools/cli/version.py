"""What ``vllm-kimi-k3-moe --version`` prints: the plugin's version, the vLLM
series it supports and the vLLM installed; and the fingerprint of the
plugin's code that ``doctor`` prints, to tell nodes apart.

Read from package metadata and the package's files only: importing vLLM takes
about 10 s and is what fails on a broken install, which is when a bug report
needs these lines.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.compat import supported_vllm_series

DISTRIBUTION = "vllm-kimi-k3-moe"
PACKAGE_ROOT = Path(vllm_kimi_k3_moe.__file__).parent
FINGERPRINT_DIGITS = 12  # 48 bits: two different codes never meet by chance


def installed_version(distribution: str) -> str | None:
    """``distribution``'s installed version, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_report() -> str:
    """Three lines: the plugin, the vLLM it supports, the vLLM installed."""
    plugin = installed_version(DISTRIBUTION) or "unknown (run from source)"
    return "\n".join(
        [
            f"{DISTRIBUTION} {plugin}",
            f"supported vLLM {supported_vllm_series()}",
            f"installed vLLM {installed_version('vllm') or 'not installed'}",
        ]
    )


def code_fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """The first hex digits of the SHA-256 of the package's Python source:
    each ``.py`` file's path inside the package and its bytes, in path order.
    Two nodes print the same fingerprint exactly when they run the same code,
    whatever their version says (a checkout, a wheel, an install edited in
    place); bytecode and where the package is installed do not count."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).parts):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:FINGERPRINT_DIGITS]
