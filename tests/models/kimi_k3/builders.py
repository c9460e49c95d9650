"""What the Kimi-K3 tests build from: the model's text config, the MXFP4
formats, the poison byte, one real ``KimiMoE`` and a built layer's routed
experts."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.text_config import KIMI_K3_MOE_FIELDS

POISON = 0xA5  # the byte uninitialised memory reads as in these tests

# Native MXFP4 (the released checkpoint, rewritten by vLLM) and the
# compressed-tensors MXFP4 method (other compressed-tensors formats).
MXFP4_FORMATS = (mxfp4.RELEASE.name, mxfp4.COMPRESSED_TENSORS.name)
on_both_quantization_paths = pytest.mark.parametrize("quantization", MXFP4_FORMATS)


def kimi_k3_text_config(*, small: bool = False, **overrides: Any) -> Any:
    """Kimi-K3's MoE text config as vLLM's ``KimiLinearConfig``; ``small``
    keeps 3072 but shrinks widths and experts; ``overrides`` set any field."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    fields = dict(KIMI_K3_MOE_FIELDS)
    if small:
        fields.update(
            hidden_size=k3.SMALL_HIDDEN_SIZE,
            routed_expert_hidden_size=k3.SMALL_ROUTED_EXPERT_HIDDEN_SIZE,
            num_experts=k3.SMALL_NUM_EXPERTS,
            num_experts_per_token=k3.SMALL_NUM_EXPERTS_PER_TOKEN,
        )
    return KimiLinearConfig(**{**fields, **overrides})


def build_kimi_moe_layer(
    kimi_moe_cls: type,
    config: Any,
    vllm_config: Any,
    device: str = "meta",
    prefix: str = "model.layers.1.block_sparse_moe",
) -> Any:
    """Construct ``kimi_moe_cls`` the way ``KimiDecoderLayer`` does, under
    ``vllm_config`` and on ``device`` (``meta``: real shapes, no memory)."""
    import torch
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), torch.device(device):
        return kimi_moe_cls(
            config, vllm_config, quant_config=vllm_config.quant_config, prefix=prefix
        )


def moe_layers_only_builder(kimi_model: Any) -> Any:
    """``build(vllm_config, kimi_moe_cls)``: Kimi-K3's module tree with only
    its MoE layers (``kimi_model``: vLLM's Kimi-K3 NVIDIA model module), for
    loading a checkpoint; see the ``moe_layers_only_model`` fixture."""

    class MoeLayersOnlyTextModel(kimi_model.KimiLinearModel):
        def __init__(self, config: Any, layers: nn.ModuleList) -> None:
            nn.Module.__init__(self)  # none of KimiLinearModel's own layers
            self.config = config
            self.layers = layers

    def build(vllm_config: Any, kimi_moe_cls: type) -> nn.Module:
        config = vllm_config.model_config.hf_text_config
        layers = nn.ModuleList()
        for index in range(config.num_hidden_layers):
            layer = nn.Module()
            if (
                index >= config.first_k_dense_replace
                and index % config.moe_layer_freq == 0
            ):
                layer.block_sparse_moe = build_kimi_moe_layer(
                    kimi_moe_cls,
                    config,
                    vllm_config,
                    device="cpu",
                    prefix=f"language_model.model.layers.{index}.block_sparse_moe",
                )
            layers.append(layer)
        model = nn.Module()
        model.language_model = nn.Module()
        model.language_model.model = MoeLayersOnlyTextModel(config, layers)
        return model

    return build


def routed_experts(moe: nn.Module) -> nn.Module:
    """The ``RoutedExperts`` that owns the expert parameters of a ``KimiMoE``."""
    return moe.experts.routed_experts
