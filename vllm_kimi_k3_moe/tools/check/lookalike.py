"""Expert tensors in another format, or under other names, than ``config.json`` says.

A ``config.json`` that lost its ``quantization_config`` declares BF16 while
the tensors stay MXFP4: every expected tensor is then missing and every
stored one unexpected, hundreds of thousands of problems with one cause.
Holding a few experts spread over the layers to each published format's
tensor contracts (names, dtypes, shapes: the registry's records) names that
cause in one line; so does trying the other model prefix (a flat
``config.json`` makes vLLM read ``model.layers.``, a nested one
``language_model.layers.``). Dictionary lookups only, and only when
something is wrong.
"""

from __future__ import annotations

import dataclasses

from vllm_kimi_k3_moe.formats import CheckpointFormat, published_checkpoint_formats
from vllm_kimi_k3_moe.formats.safetensors_headers import HeaderTensor
from vllm_kimi_k3_moe.tools.check.layout import (
    CONFIG_FILE,
    MULTIMODAL_PREFIX,
    TEXT_ONLY_PREFIX,
    KimiK3Layout,
)

SAMPLED_LAYERS = 8  # spread over the MoE layers; the first and last expert of each


def _sampled_experts(layout: KimiK3Layout) -> list[str]:
    layers = layout.layers
    step = max(1, len(layers) // SAMPLED_LAYERS)
    last = layout.num_experts - 1
    return [
        layout.expert_prefix(layer, expert)
        for layer in layers[::step]
        for expert in sorted({0, last})
    ]


def _fits(
    layout: KimiK3Layout,
    fmt: CheckpointFormat,
    expert: str,
    tensors: dict[str, HeaderTensor],
) -> bool:
    """Every tensor of ``fmt`` for this expert is there and fits its contract."""
    for key, contract in layout.contracts(fmt):
        tensor = tensors.get(expert + key)
        if tensor is None or not contract.fits(tensor.shape, tensor.dtype):
            return False
    return True


def _best_fit(
    layout: KimiK3Layout, tensors: dict[str, HeaderTensor]
) -> CheckpointFormat | None:
    """The format the sampled experts under ``layout.prefix`` fit: the
    declared one if any of them does, else the published format most of
    them fit (None: none fits anything known)."""
    experts = _sampled_experts(layout)
    if any(_fits(layout, layout.format, expert, tensors) for expert in experts):
        return layout.format
    best, best_count = None, 0
    for fmt in published_checkpoint_formats():
        if fmt.tensors == layout.format.tensors:
            continue
        count = sum(_fits(layout, fmt, expert, tensors) for expert in experts)
        if count > best_count:
            best, best_count = fmt, count
    return best


def mismatch(layout: KimiK3Layout, tensors: dict[str, HeaderTensor]) -> str | None:
    """The one line that explains the problems, when the expert tensors are
    in another format than declared, or under the other model prefix (a
    flat config.json for a multimodal checkpoint, or the reverse); None
    when the declared format and names fit some sampled expert."""
    stored = _best_fit(layout, tensors)
    if stored is layout.format:
        return None
    if stored is not None:
        return (
            f"{_declared(layout)} but the expert tensors are {_looks(layout, stored)}"
        )
    other = MULTIMODAL_PREFIX if layout.prefix == TEXT_ONLY_PREFIX else TEXT_ONLY_PREFIX
    renamed = dataclasses.replace(layout, prefix=other)
    stored = _best_fit(renamed, tensors)
    if stored is None:
        return None
    nested = (
        "nests text_config"
        if layout.prefix == MULTIMODAL_PREFIX
        else ("has no text_config")
    )
    line = (
        f"{CONFIG_FILE} {nested}, so vLLM's Kimi-K3 loader reads the experts as "
        f"{layout.prefix}N.block_sparse_moe.experts.E.*, but the checkpoint "
        f"names them {other}N.block_sparse_moe.experts.E.*"
    )
    if stored is not layout.format:
        line += f", and they are {_looks(layout, stored)}"
    return line


def _declared(layout: KimiK3Layout) -> str:
    declared = layout.format
    unquantized = declared.format.published_config is None
    return f"{layout.declared_in} declares " + (
        "no quantization" if unquantized else declared.name
    )


def _looks(layout: KimiK3Layout, stored: CheckpointFormat) -> str:
    """ "MXFP4-packed (weight_packed U8, weight_scale U8 per projection)"."""
    contracts = stored.tensors.contracts(layout.hidden, layout.intermediate)
    tensors = ", ".join(
        f"{suffix} {contract.dtype_text}"
        for (projection, suffix), contract in contracts.items()
        if projection == "w1"
    )
    return f"{stored.format.stored_as} ({tensors} per projection)"
