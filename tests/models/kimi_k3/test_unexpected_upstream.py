"""If a vLLM ``KimiMoE`` hands ``FusedMoEFactory`` a size the patch was not written
for, building the layer stops with an error naming the sizes."""

from __future__ import annotations

import types

import pytest
from torch import nn

from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import apply


def changed_upstream_module(passes: int) -> types.ModuleType:
    """Stands in for a future vLLM model module whose ``KimiMoE`` passes
    ``passes`` to the factory (0.33.0 itself cannot be made to do this)."""
    module = types.ModuleType("future_vllm_kimi_k3_model")
    module.FusedMoEFactory = lambda **kwargs: kwargs["intermediate_size"]

    class KimiMoE(nn.Module):
        """Pads like 0.33.0 (8192 at TP32), then calls the module's factory."""

        def __init__(self, config, vllm_config):
            super().__init__()
            self.padded_moe_intermediate_size = 8192
            self.received = module.FusedMoEFactory(intermediate_size=passes)

    module.KimiMoE = KimiMoE
    apply(module)
    return module


@pytest.mark.parametrize("passes", [6144, 2048])
def test_unexpected_factory_size_is_refused(passes):
    module = changed_upstream_module(passes)
    config = types.SimpleNamespace(moe_intermediate_size=3072)
    with pytest.raises(RuntimeError) as error:
        module.KimiMoE(config, None)
    message = str(error.value)
    assert f"intermediate_size={passes}" in message
    assert "moe_intermediate_size=3072" in message
    assert "padded_moe_intermediate_size=8192" in message


@pytest.mark.parametrize(("passes", "received"), [(8192, 3072), (3072, 3072)])
def test_expected_sizes_reach_the_factory_as_logical(passes, received):
    """The model-level size is swapped for the logical one; a logical size (an
    upstream that is already fixed) passes through untouched."""
    module = changed_upstream_module(passes)
    moe = module.KimiMoE(types.SimpleNamespace(moe_intermediate_size=3072), None)
    assert moe.received == received
    assert moe.padded_moe_intermediate_size == 8192
