"""Which ``plan --quantization`` names are vLLM's online methods: a BF16
Kimi-K3 checkpoint quantized while vLLM loads it (``vllm serve
--quantization fp8_per_block``, ...).

A name ``plan`` knows as a checkpoint format (``vllm_kimi_k3_moe.formats``:
``mxfp4`` is the release) stays the format. Any other is held to the
installed vLLM's own list of ``--quantization`` names
(``QUANTIZATION_METHODS``), so what ``plan`` takes ``vllm serve`` takes;
whether the name gives the routed experts a method that quantizes while
loading is vLLM's to say when the layer is built (``plan`` says its
refusal). ``online`` (vLLM's name for ``--quantization-config``'s methods)
is refused: ``plan`` does not take that flag.
"""

from __future__ import annotations

from vllm_kimi_k3_moe.formats import FORMAT_NAMES, FormatError

# the method ``online`` names: --quantization-config's, which plan does not take
ONLINE_CONFIG = "online"


def vllm_quantization_names() -> list[str]:
    """The ``--quantization`` names the installed vLLM accepts."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return list(QUANTIZATION_METHODS)


def online_method(name: str) -> str | None:
    """``name`` as an online method (None: it names a checkpoint format).
    ``FormatError`` (one line, naming ``name`` and what is accepted) where
    neither ``plan`` nor vLLM knows it."""
    if name in FORMAT_NAMES:
        return None
    accepted = [n for n in vllm_quantization_names() if n not in FORMAT_NAMES]
    if name == ONLINE_CONFIG:
        raise FormatError(
            "--quantization online takes its methods from vLLM's "
            "--quantization-config, which plan does not take; name the method "
            "(e.g. --quantization fp8_per_block)"
        )
    if name not in accepted:
        raise FormatError(
            f"unknown --quantization {name!r}: neither a checkpoint format "
            f"({', '.join(FORMAT_NAMES)}) nor a method vLLM accepts "
            f"({', '.join(n for n in accepted if n != ONLINE_CONFIG)})"
        )
    return name
