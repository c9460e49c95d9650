"""The formats Kimi-K3 is published in: one record each, read by every consumer.

Each format module (``mxfp4``, ``fp8_block``, ``nvfp4``, ``w4a16``,
``auto_awq_gptq``, ``bf16``) defines its record(s) (``record.KimiK3Format``):
the one name the command line, JSON, tests and messages use, its display
title, how its checkpoint's config is recognised (by the parameters vLLM
reads: bits, group size, symmetry), the vLLM methods that load its experts,
its experts' checkpoint tensors, its partition rule, the ``--moe-backend``
names offered for it and its published ``quantization_config``. The
serving patches (partition, strict loading) and the tools (``plan``,
``check``) look formats up here only.

Adding a format: a module with its record and rule, a line in ``FORMATS``,
and the tests that walk the registry (``tests/test_formats.py``) tell what
is missing.

Plain Python: importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm_kimi_k3_moe.formats import (
    auto_awq_gptq,
    bf16,
    fp8_block,
    mxfp4,
    nvfp4,
    w4a16,
)
from vllm_kimi_k3_moe.formats.compressed_tensors import (
    expert_weights,
    weight_signature,
)
from vllm_kimi_k3_moe.formats.record import (
    CheckpointFormat,
    FormatError,
    KimiK3Format,
    QuantizationScheme,
)

__all__ = [
    "FORMATS",
    "FORMAT_NAMES",
    "CheckpointFormat",
    "FormatError",
    "KimiK3Format",
    "format_named",
    "format_of_method",
    "published_checkpoint_formats",
    "recognise",
]

FORMATS: tuple[KimiK3Format, ...] = (
    mxfp4.RELEASE,
    mxfp4.COMPRESSED_TENSORS,
    fp8_block.FP8_BLOCK,
    nvfp4.COMPRESSED_TENSORS,
    nvfp4.MODELOPT,
    w4a16.W4A16,
    auto_awq_gptq.AWQ,
    auto_awq_gptq.GPTQ,
    bf16.BF16,
)
FORMAT_NAMES = tuple(f.name for f in FORMATS)
_BY_NAME = {f.name: f for f in FORMATS}


def format_named(name: str) -> KimiK3Format:
    """The format called ``name``; ``FormatError`` naming the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise FormatError(
            f"unknown format {name!r}; choose one of {', '.join(FORMAT_NAMES)}"
        ) from None


def format_of_method(method: Any) -> KimiK3Format | None:
    """The format whose experts vLLM's MoE quantization ``method`` loads, or
    None for a method (or a strategy of one: channel-wise FP8, ungrouped
    INT) no format is loaded by."""
    for cls in type(method).__mro__:
        for fmt in FORMATS:
            if cls.__name__ in fmt.vllm_methods:
                return fmt if fmt.is_method(method) else None
    return None


def _refuse(where: str, found: str) -> FormatError:
    known = ", ".join(f.title for f in FORMATS)
    return FormatError(f"{where}: {found}; check knows {known}")


def _scheme(
    quantization_config: Any, hf_quant_config: Any, where: str
) -> QuantizationScheme:
    """What the config files say, refusing what no format could be."""
    if isinstance(hf_quant_config, dict):
        algo = (hf_quant_config.get("quantization") or {}).get("quant_algo")
        return QuantizationScheme("modelopt", quant_algo=algo)
    if quantization_config is None:
        return QuantizationScheme(None)
    if not isinstance(quantization_config, dict):
        raise _refuse(where, "quantization_config is not an object")
    method = quantization_config.get("quant_method")
    if method is None:  # vLLM reads no method from it either
        raise _refuse(where, "quantization_config has no quant_method")
    fmt = quantization_config.get("format")
    if method == "compressed-tensors":
        weights = expert_weights(quantization_config)
        if weights is None and fmt != mxfp4.RELEASE_FORMAT:
            raise _refuse(
                where, f"no compressed-tensors group targets the experts ({fmt})"
            )
        return QuantizationScheme(method, fmt, weights)
    return QuantizationScheme(
        method,
        quant_algo=quantization_config.get("quant_algo"),
        config=quantization_config,
    )


def recognise(
    quantization_config: Any, hf_quant_config: Any, where: str
) -> CheckpointFormat:
    """The format ``config.json``'s ``quantization_config`` (or ModelOpt's
    ``hf_quant_config.json``) describes, as vLLM 0.33.0 will pick the
    experts' method; ``where`` names the file in errors."""
    scheme = _scheme(quantization_config, hf_quant_config, where)
    for fmt in FORMATS:
        recognised = fmt.recognises(scheme)
        if recognised is not None:
            return recognised
    if isinstance(hf_quant_config, dict):
        raise _refuse(
            f"{where} (hf_quant_config.json)", f"quant_algo {scheme.quant_algo!r}"
        )
    if scheme.quant_method == "compressed-tensors":
        bits, kind, strategy, _ = weight_signature(scheme.expert_weights)
        raise _refuse(
            where,
            f"compressed-tensors {scheme.ct_format} with {bits}-bit {kind} "
            f"{strategy} weights",
        )
    if scheme.quant_method == "modelopt":
        raise _refuse(where, f"ModelOpt quant_algo {scheme.quant_algo!r}")
    raise _refuse(where, f"quantization_config.quant_method {scheme.quant_method!r}")


def published_checkpoint_formats() -> list[CheckpointFormat]:
    """Each format as its published ``quantization_config`` makes it, one per
    distinct expert tensor layout (compressed-tensors MXFP4 stores its
    experts as the release does): what ``check`` compares expert tensors
    with when they do not fit the format ``config.json`` declares."""
    found: list[CheckpointFormat] = []
    for fmt in FORMATS:
        published = recognise(fmt.published_quantization_config(), None, fmt.name)
        if all(other.tensors != published.tensors for other in found):
            found.append(published)
    return found
