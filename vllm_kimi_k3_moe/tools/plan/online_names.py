"""Which ``plan --quantization`` names are vLLM's online methods: a BF16
Kimi-K3 checkpoint quantized while vLLM loads it (``vllm serve
--quantization fp8_per_block``, ...).

A name ``plan`` knows as a checkpoint format (``vllm_kimi_k3_moe.formats``:
``mxfp4`` is the release) stays the format, but where vLLM reads it as
an online method too (``mxfp4``: one of its ``ONLINE_QUANT_SHORTHAND_NAMES``)
and ``--config`` is a BF16 checkpoint's (no ``quantization_config``): vLLM
merges such a name's online defaults in only once the checkpoint is known to
be unquantized (``resolve_quantization_config``'s deferred shorthands), so
over a BF16 checkpoint ``--quantization mxfp4`` quantizes while loading.
Any other is held to the
installed vLLM's own list of ``--quantization`` names
(``QUANTIZATION_METHODS``), so what ``plan`` takes ``vllm serve`` takes;
whether the name gives the routed experts a method that quantizes while
loading is vLLM's to say when the layer is built (``plan`` says its
refusal). ``online`` (vLLM's name for ``--quantization-config``'s methods)
needs that flag. ``--quantization-config JSON`` is held to vLLM's own
reading of the two flags (``resolve_quantization_config``) and kept as the
JSON vLLM is given; over a checkpoint that declares a quantization_config
(vLLM composes the two) ``plan`` and ``check`` do not size it yet, and say
so.
"""

from __future__ import annotations

import json

from vllm_kimi_k3_moe.formats import FORMAT_NAMES, FormatError
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm
from vllm_kimi_k3_moe.tools.suggest import closest

# the method ``online`` names: --quantization-config's
ONLINE_CONFIG = "online"


def vllm_quantization_names() -> list[str]:
    """The ``--quantization`` names the installed vLLM accepts (importing
    vLLM: what torch prints then is kept off the answer's screen)."""
    with quiet_vllm():
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return list(QUANTIZATION_METHODS)


def _online_shorthands() -> tuple[str, ...]:
    """The ``--quantization`` names vLLM reads as online methods."""
    with quiet_vllm():
        from vllm.config.quantization import ONLINE_QUANT_SHORTHAND_NAMES

    return ONLINE_QUANT_SHORTHAND_NAMES


def online_method(
    name: str, bf16_checkpoint: bool = False, with_config: bool = False
) -> str | None:
    """``name`` as an online method (None: it names a checkpoint format);
    ``bf16_checkpoint``: ``--config`` declares no quantization_config;
    ``with_config``: ``--quantization-config`` was given. ``FormatError``
    (one line, naming ``name`` and what is accepted) where neither ``plan``
    nor vLLM knows it."""
    if name in FORMAT_NAMES:
        online = bf16_checkpoint and name in _online_shorthands()
        return name if online else None
    accepted = [n for n in vllm_quantization_names() if n not in FORMAT_NAMES]
    if name == ONLINE_CONFIG and not with_config:
        raise FormatError(
            "--quantization online takes its methods from --quantization-config "
            """(e.g. '{"moe": "fp8_per_block"}'); give it, or name the method """
            "(e.g. --quantization fp8_per_block)"
        )
    if name not in accepted:
        suggestion = closest(name, [*FORMAT_NAMES, *accepted])
        raise FormatError(
            f"unknown --quantization {name!r}: neither a checkpoint format "
            f"({', '.join(FORMAT_NAMES)}) nor a method vLLM accepts "
            f"({', '.join(n for n in accepted if n != ONLINE_CONFIG)})"
            + (f"; did you mean {suggestion!r}?" if suggestion else "")
        )
    return name


def online_config(name: str | None, text: str, declared: bool) -> str:
    """``--quantization-config text`` as vLLM is given it with
    ``--quantization name`` (one line of JSON), once vLLM's own reading of the
    two flags takes it; ``declared``: the checkpoint declares a
    quantization_config. ``FormatError`` (one line, naming the value) where
    it is not JSON, vLLM refuses it, or plan does not size it."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        reason = f"not JSON ({error})"
        raise FormatError(f"--quantization-config {text!r}: {reason}") from None
    if declared:
        raise FormatError(
            "--quantization-config over a checkpoint that declares a "
            "quantization_config (vLLM composes the two): not sized here yet"
        )
    if name is None:
        raise FormatError(
            "--quantization-config quantizes a BF16 checkpoint while loading "
            "it with --quantization online or a method's name; give one"
        )
    with quiet_vllm():
        from vllm.config.quantization import resolve_quantization_config

    try:
        resolve_quantization_config(name, parsed)
    except (TypeError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise FormatError(f"--quantization-config {text!r}: vLLM: {reason}") from None
    return json.dumps(parsed)
