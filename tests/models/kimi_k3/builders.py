"""What the Kimi-K3 tests build from: the model's text config, the MXFP4
formats, the poison byte, one real ``KimiMoE`` and a built layer's routed
experts (the selftest's own accessor)."""

from __future__ import annotations

from typing import Any

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.selftest import layer

POISON = 0xA5  # the byte uninitialised memory reads as in these tests
NAN_BYTE = 0xFF  # NaN in bf16, fp32, fp8 e4m3 and e8m0 alike
# 3.4e38 in bf16 and fp32 (0x7F7F...): finite, so every quantizer (vLLM's or a
# stand-in, whatever it does with NaN) takes it as the largest of values
HUGE_BYTE = 0x7F

# Native MXFP4 (the released checkpoint, rewritten by vLLM) and the
# compressed-tensors MXFP4 method (other compressed-tensors formats).
MXFP4_FORMATS = (mxfp4.RELEASE.name, mxfp4.COMPRESSED_TENSORS.name)


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


# A built layer's routed experts, as the selftest reads them.
routed_experts = layer.routed_experts
