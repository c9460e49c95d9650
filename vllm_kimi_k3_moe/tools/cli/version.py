"""What ``vllm-kimi-k3-moe --version`` prints: the plugin's version, the vLLM
series it supports and the vLLM installed.

Read from package metadata only: importing vLLM takes about 10 s and is what
fails on a broken install, which is when a bug report needs these lines.
"""

from __future__ import annotations

from importlib import metadata

from vllm_kimi_k3_moe.compat import supported_vllm_series

DISTRIBUTION = "vllm-kimi-k3-moe"


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
