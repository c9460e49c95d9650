"""Which of vLLM 0.33.0's MoE quantization methods a layer got, by kind.

The one place that names vLLM's method classes: the partition rules and the
strict loader's checkpoint layouts both dispatch on the kind. Classes are
matched by name along the method's MRO, so a subclass (another plugin's, or
vLLM's own) is the kind of its base, and no method module is imported.
"""

from __future__ import annotations

from typing import Any

METHOD_KINDS = {
    "Mxfp4MoEMethod": "native-mxfp4",  # the release, rewritten by vLLM
    "CompressedTensorsW4A4Mxfp4MoEMethod": "ct-mxfp4",
    "Fp8MoEMethod": "native-fp8",
    "CompressedTensorsW8A8Fp8MoEMethod": "ct-fp8-block",  # block strategy only
    "CompressedTensorsW4A4Nvfp4MoEMethod": "ct-nvfp4",
    "ModelOptNvFp4FusedMoE": "modelopt-nvfp4",
    "CompressedTensorsWNA16MoEMethod": "ct-wna16",  # grouped only
    "UnquantizedFusedMoEMethod": "bf16",
}


def method_kind(method: Any) -> str | None:
    """The kind of ``method``, or None for a method (or a strategy of one:
    channel- or tensor-wise FP8, ungrouped WNA16) the plugin knows nothing of."""
    for cls in type(method).__mro__:
        kind = METHOD_KINDS.get(cls.__name__)
        if kind == "ct-fp8-block" and not method.block_quant:
            return None
        if kind == "ct-wna16" and method.group_size <= 0:
            return None
        if kind is not None:
            return kind
    return None
