"""Expert tensors in another format than the one ``config.json`` declares.

A ``config.json`` that lost its ``quantization_config`` declares BF16 while
the tensors stay MXFP4: every expected tensor is then missing and every
stored one unexpected, hundreds of thousands of problems with one cause.
Holding a few experts spread over the layers to each published format's
tensor contracts (names, dtypes, shapes: the registry's records) names that
cause in one line. Dictionary lookups only, and only when something is wrong.
"""

from __future__ import annotations

from vllm_kimi_k3_moe.formats import CheckpointFormat, published_checkpoint_formats
from vllm_kimi_k3_moe.tools.check.layout import KimiK3Layout
from vllm_kimi_k3_moe.tools.check.safetensors_headers import HeaderTensor

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


def stored_format(
    layout: KimiK3Layout, tensors: dict[str, HeaderTensor]
) -> CheckpointFormat | None:
    """The published format the sampled experts' tensors fit, when none of
    them fits the declared one (None: they fit it somewhere, or fit nothing
    known)."""
    experts = _sampled_experts(layout)
    if any(_fits(layout, layout.format, expert, tensors) for expert in experts):
        return None
    best, best_count = None, 0
    for fmt in published_checkpoint_formats():
        if fmt.tensors == layout.format.tensors:
            continue
        count = sum(_fits(layout, fmt, expert, tensors) for expert in experts)
        if count > best_count:
            best, best_count = fmt, count
    return best


def mismatch_line(layout: KimiK3Layout, stored: CheckpointFormat) -> str:
    """ "config.json declares no quantization but the expert tensors are
    MXFP4-packed (...)": the cause, in one line."""
    declared = layout.format
    unquantized = declared.format.published_config is None
    said = "no quantization" if unquantized else declared.name
    contracts = stored.tensors.contracts(layout.hidden, layout.intermediate)
    tensors = ", ".join(
        f"{suffix} {contract.dtype_text}"
        for (projection, suffix), contract in contracts.items()
        if projection == "w1"
    )
    return (
        f"{layout.declared_in} declares {said} but the expert tensors are "
        f"{stored.format.stored_as} ({tensors} per projection)"
    )
