"""One rank's Kimi-K3 routed-expert layer, as vLLM builds and loads it.

The layer is vLLM's ``KimiMoE`` (the plugin's, or vLLM alone's), built as
``KimiDecoderLayer`` builds it under the rank's ``VllmConfig`` (from a
``config.json`` vLLM resolves as a checkpoint's), with the model's dtype as
the default and on the device, as vLLM's model loader builds a model
(``BaseModelLoader.load_model``). It sits in Kimi-K3's module tree at
``language_model.model.layers.1.block_sparse_moe``, so that vLLM's own
loading reaches it: ``AutoWeightsLoader`` with Kimi-K3's checkpoint name
mapper, ``KimiLinearModel.load_weights`` (the expert mapping), each
parameter's ``weight_loader``. The layer has no shared experts: they are not
routed, and without them vLLM's MoE runner runs exactly the routed experts.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    one_layer_of_each,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Serving
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.selftest.checkpoint import LAYER
from vllm_kimi_k3_moe.tools.selftest.shape import MoeShape

if TYPE_CHECKING:
    from torch import Tensor, nn


def layer_text_config(text_config: dict[str, Any], shape: MoeShape) -> dict[str, Any]:
    """Kimi-K3's text config (``text_config`` over the published one) cut to
    a dense layer 0 and the MoE layer 1, with ``shape``'s widths and experts
    and no shared experts."""
    return {
        **one_layer_of_each({**KIMI_K3_TEXT_CONFIG, **text_config}),
        "hidden_size": shape.hidden,
        "routed_expert_hidden_size": shape.width,
        "num_experts": shape.experts,
        "num_shared_experts": None,
    }


def write_layer_config(
    directory: Path,
    text_config: dict[str, Any],
    shape: MoeShape,
    quantization_config: dict[str, Any] | None,
) -> Path:
    """The ``config.json`` every rank is built from, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return write_model_dir(
        layer_text_config(text_config, shape), quantization_config, Serving(), directory
    )


@functools.cache
def _moe_layer_tree(kimi_model: ModuleType) -> type:
    from torch import nn

    class MoeLayerTextModel(kimi_model.KimiLinearModel):
        """``KimiLinearModel`` holding only its layers (its ``load_weights``
        and expert mapping are vLLM's)."""

        def __init__(self, config: Any, layers: nn.ModuleList) -> None:
            nn.Module.__init__(self)  # none of KimiLinearModel's own layers
            self.config = config
            self.layers = layers

    return MoeLayerTextModel


def build_moe_layers(
    kimi_model: ModuleType, kimi_moe_cls: type, vllm_config: Any, device: str
) -> nn.Module:
    """Kimi-K3's module tree with a ``kimi_moe_cls`` at every MoE layer of
    the config (the selftest's has one, ``LAYER``), built as
    ``KimiDecoderLayer`` builds it, under ``vllm_config`` on ``device`` with
    the model's dtype as the default (the caller makes ``vllm_config``
    current); the other layers are empty."""
    import torch
    from torch import nn
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = vllm_config.model_config.hf_text_config
    layers = nn.ModuleList(nn.Module() for _ in range(config.num_hidden_layers))
    with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device(device):
        for index, layer in enumerate(layers):
            if (
                index >= config.first_k_dense_replace
                and index % config.moe_layer_freq == 0
            ):
                prefix = f"language_model.model.layers.{index}.block_sparse_moe"
                layer.block_sparse_moe = _as_its_decoder_builds_it(
                    kimi_moe_cls, config, vllm_config, prefix, index
                )
    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.model = _moe_layer_tree(kimi_model)(config, layers)
    return model


def _as_its_decoder_builds_it(
    kimi_moe_cls: type, config: Any, vllm_config: Any, prefix: str, index: int
) -> nn.Module:
    """A ``KimiMoE`` built as its model's ``KimiDecoderLayer`` builds it: the
    NVIDIA one takes the ``VllmConfig`` (``nvidia/model.py``), the AMD one
    (``amd/linear.py``, ROCm and XPU) the quantization config and the layer's
    index, by keyword."""
    quant_config = vllm_config.quant_config
    if "vllm_config" in inspect.signature(upstream_class(kimi_moe_cls)).parameters:
        return kimi_moe_cls(
            config, vllm_config, quant_config=quant_config, prefix=prefix
        )
    return kimi_moe_cls(
        config=config, quant_config=quant_config, prefix=prefix, layer_idx=index
    )


def vision_language_model(kimi_model: ModuleType) -> type:
    """The VL wrapper whose checkpoint names load into ``kimi_model``'s
    layers (its ``hf_to_vllm_mapper``): ``amd/model.py``'s for the AMD
    language model (ROCm), else NVIDIA's."""
    if kimi_model.__name__.endswith(".amd.linear"):
        from vllm.models.kimi_k3.amd.model import KimiK3ForConditionalGeneration

        return KimiK3ForConditionalGeneration
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    return KimiK3ForConditionalGeneration


def kimi_moe(model: nn.Module) -> nn.Module:
    """The ``KimiMoE`` at ``LAYER`` of ``build_moe_layers``' tree."""
    return model.language_model.model.layers[LAYER].block_sparse_moe


def routed_experts(moe: nn.Module) -> nn.Module:
    """The ``RoutedExperts`` that owns a ``KimiMoE``'s expert parameters."""
    return moe.experts.routed_experts


def load_experts(
    model: nn.Module, tensors: dict[str, Tensor], wrapper: type | None = None
) -> None:
    """Load the checkpoint's expert tensors into ``model`` as vLLM's model
    loader hands a checkpoint to Kimi-K3 (``DefaultModelLoader.load_weights``
    calls ``load_weights`` with its shards' tensors), through the mapper of
    the VL ``wrapper`` (``vision_language_model``; default: NVIDIA's)."""
    from vllm.model_executor.models.utils import AutoWeightsLoader

    if wrapper is None:
        from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

        wrapper = KimiK3ForConditionalGeneration
    AutoWeightsLoader(model).load_weights(
        tensors.items(), mapper=wrapper.hf_to_vllm_mapper
    )
