"""Which vLLM releases and platforms the patches were written for.

Each function returns ``None`` when patching is safe, otherwise the sentence the
plugin logs instead of patching.
"""

from __future__ import annotations

# The one place the supported vLLM is named. The patches rewrite private
# construction details of the release they were written and tested against;
# the plugin accepts its series (major.minor), which pyproject.toml's vllm
# requirement admits exactly (a test ties the two). Every message naming
# vLLM derives from these.
TESTED_VLLM_RELEASE = "0.33.0"
SUPPORTED_VLLM_SERIES = tuple(int(n) for n in TESTED_VLLM_RELEASE.split(".")[:2])
VLLM = f"vLLM {TESTED_VLLM_RELEASE}"  # as messages name it


def supported_vllm_series() -> str:
    """``SUPPORTED_VLLM_SERIES`` as users write it: ``0.33.x``."""
    return ".".join(map(str, SUPPORTED_VLLM_SERIES)) + ".x"


def vllm_version_refusal() -> str | None:
    from vllm.version import __version__, __version_tuple__

    if tuple(__version_tuple__[:2]) == SUPPORTED_VLLM_SERIES:
        return None
    return (
        f"vllm-kimi-k3-moe supports vLLM {supported_vllm_series()} only, "
        f"found vLLM {__version__}; "
        "Kimi-K3 MoE padding is left as upstream (nothing patched). Install a "
        "vllm-kimi-k3-moe release made for this vLLM, or uninstall it if this vLLM "
        "already lets the quantization backend own the padding."
    )


def kimi_k3_platform_refusal() -> str | None:
    """Mirror ``vllm/models/kimi_k3/__init__.py``: which implementation runs."""
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        implementation = "vllm.models.kimi_k3.amd (ROCm)"
    elif current_platform.device_type == "tpu":
        implementation = "the TPU plugin's own model"
    else:
        return None
    return (
        f"vllm-kimi-k3-moe patches the NVIDIA Kimi-K3 model only; this platform "
        f"runs {implementation}, which is left as upstream (nothing patched)."
    )
