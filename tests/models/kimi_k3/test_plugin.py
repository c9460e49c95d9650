"""The plugin registers through vLLM's entry point, cheaply, once, only on
NVIDIA and on vLLM code it verified, and the Kimi-K3 layers vLLM builds
afterwards carry the fix."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

import vllm_kimi_k3_moe
from tests.models.kimi_k3.builders import kimi_k3_text_config
from vllm_kimi_k3_moe import import_hooks
from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import BackendPaddedKimiMoE, apply
from vllm_kimi_k3_moe.patching import is_plugin_wrapper, upstream_class
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

ENTRY_POINT = "kimi_k3_moe"
NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"
AMD_LINEAR = "vllm.models.kimi_k3.amd.linear"

# Runs in a fresh interpreter: what vLLM's own plugin loading does to a process.
LOAD_GENERAL_PLUGINS = """
import json, sys
import torch
cuda_inits = []
torch.cuda._lazy_init = lambda: cuda_inits.append(True)
import vllm.plugins
from vllm_kimi_k3_moe import import_hooks
vllm.plugins.load_general_plugins()
print(json.dumps({
    "watched": sorted(import_hooks.watched_modules()),
    "kimi_k3_imported": sorted(m for m in sys.modules
                               if m.startswith("vllm.models.kimi_k3")),
    "cuda_inits": len(cuda_inits),
    "cuda_initialized": torch.cuda.is_initialized(),
}))
"""


def test_entry_point_is_discoverable():
    (plugin,) = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.name == ENTRY_POINT
    ]
    assert plugin.value == "vllm_kimi_k3_moe:register"
    assert plugin.load() is vllm_kimi_k3_moe.register


@pytest.mark.parametrize(
    ("allow_list", "watched"),
    [
        (None, [vllm_kimi_k3_moe.KIMI_K3_PACKAGE, AMD_LINEAR, NVIDIA_MODEL]),
        (ENTRY_POINT, [vllm_kimi_k3_moe.KIMI_K3_PACKAGE, AMD_LINEAR, NVIDIA_MODEL]),
        ("lora_filesystem_resolver", []),  # an allow-list without us
    ],
)
def test_load_general_plugins_registers_lazily(allow_list, watched):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if allow_list is not None:
        env["VLLM_PLUGINS"] = allow_list
    result = subprocess.run(
        [sys.executable, "-c", LOAD_GENERAL_PLUGINS],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "watched": watched,
        "kimi_k3_imported": [],
        "cuda_inits": 0,
        "cuda_initialized": False,
    }


def decoder_layer_config():
    """Kimi-K3's text config with the MLA fields a decoder layer asserts on
    (their values only reach the attention stand-in)."""
    config = kimi_k3_text_config()
    config.num_hidden_layers = 3
    config.qk_nope_head_dim, config.qk_rope_head_dim = 128, 64
    config.v_head_dim, config.kv_lora_rank, config.mla_use_nope = 128, 512, True
    return config


def build_tp32_rank_on_meta(rank_config, make_layer):
    from vllm.config import set_current_vllm_config

    vllm_config = rank_config(Topology(32))
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        return make_layer(decoder_layer_config(), vllm_config)


def test_decoder_layer_built_afterwards_holds_patched_moe(
    kimi_model, rank_config, decoder_layer_on_cpu
):
    layer = build_tp32_rank_on_meta(
        rank_config,
        lambda config, vllm_config: kimi_model.KimiDecoderLayer(
            config, vllm_config, prefix="model.layers.1"
        ),
    )
    moe = layer.block_sparse_moe
    assert isinstance(moe, BackendPaddedKimiMoE)
    assert moe.experts.routed_experts.intermediate_size_per_partition == 128


def test_mtp_draft_layer_holds_patched_moe(
    kimi_model, rank_config, decoder_layer_on_cpu
):
    mtp = importlib.import_module("vllm.models.kimi_k3.nvidia.mtp")
    draft = build_tp32_rank_on_meta(
        rank_config,
        lambda config, vllm_config: mtp.KimiK3MultiTokenPredictorLayer(
            config, vllm_config, prefix="model.layers.3"
        ),
    )
    moe = draft.mtp_block.block_sparse_moe
    assert isinstance(moe, BackendPaddedKimiMoE)
    assert isinstance(moe, mtp.KimiMoE)  # the draft model's own isinstance check
    assert moe.experts.routed_experts.intermediate_size_per_partition == 128


def test_repeated_registration_changes_nothing(kimi_model):
    patched_cls, factory = kimi_model.KimiMoE, kimi_model.FusedMoEFactory
    meta_path = list(sys.meta_path)
    watched = import_hooks.watched_modules()

    vllm_kimi_k3_moe.register()
    vllm_kimi_k3_moe.register()
    apply(kimi_model)

    assert kimi_model.KimiMoE is patched_cls
    assert kimi_model.FusedMoEFactory is factory
    assert sys.meta_path == meta_path
    assert import_hooks.watched_modules() == watched


def test_unregister_puts_upstream_back(kimi_model, fresh_registration):
    from vllm.model_executor.layers.fused_moe import routed_experts

    assert kimi_model.KimiMoE is upstream_class(kimi_model.KimiMoE)
    assert import_hooks.watched_modules() == frozenset()
    assert not [f for f in sys.meta_path if type(f).__module__ == import_hooks.__name__]
    get_quant_method = routed_experts.RoutedExperts._get_quant_method
    assert not is_plugin_wrapper(get_quant_method)


def test_another_version_with_verified_code_is_patched(
    kimi_model, fresh_registration, monkeypatch
):
    """The version string alone decides nothing: verified code calling itself
    0.35.0 is patched, and one line says it was verified on this vLLM."""
    import vllm.version

    monkeypatch.setattr(vllm.version, "__version__", "0.35.0")
    monkeypatch.setattr(vllm.version, "__version_tuple__", (0, 35, 0))
    fresh_registration.set_level(logging.INFO, logger=vllm_kimi_k3_moe.logger.name)
    vllm_kimi_k3_moe.register()
    vllm_kimi_k3_moe.register()

    assert issubclass(kimi_model.KimiMoE, BackendPaddedKimiMoE)
    (record,) = [r for r in fresh_registration.records if "verified" in r.message]
    assert record.levelno == logging.INFO
    assert "verified on this vLLM (0.35.0)" in record.getMessage()
    assert [r for r in fresh_registration.records if r.levelno >= logging.WARNING] == []


def test_code_that_differs_patches_nothing_in_one_warning(
    kimi_model, fresh_registration, monkeypatch
):
    """One target gone (a private method renamed in a nightly): no patch goes
    on, not even those whose code is the same; one warning names it."""
    from vllm.model_executor.layers.fused_moe import routed_experts

    own = routed_experts.RoutedExperts.__dict__["_get_quant_method"]
    monkeypatch.delattr(routed_experts.RoutedExperts, "_get_quant_method")
    monkeypatch.setattr(
        routed_experts.RoutedExperts, "_build_quant_method", own, raising=False
    )
    vllm_kimi_k3_moe.register()

    assert kimi_model.KimiMoE is upstream_class(kimi_model.KimiMoE)
    (record,) = fresh_registration.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "nothing patched" in message and "\n" not in message
    assert "RoutedExperts._get_quant_method" in message


def test_tpu_is_refused(kimi_model, fresh_registration, monkeypatch):
    """A TPU runs its plugin's own Kimi-K3 model: nothing of vLLM's is
    patched, and the line says why (ROCm and XPU are patched: ``amd``)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "tpu")
    vllm_kimi_k3_moe.register()  # both modules are imported: hooks run now

    assert kimi_model.KimiMoE is upstream_class(kimi_model.KimiMoE)
    (record,) = fresh_registration.records
    assert "TPU plugin's own model" in record.getMessage()
    assert "nothing patched" in record.getMessage()


def test_registration_on_supported_vllm_patches_imported_module(
    kimi_model, fresh_registration
):
    vllm_kimi_k3_moe.register()
    assert issubclass(kimi_model.KimiMoE, BackendPaddedKimiMoE)
    assert fresh_registration.records == []


def _patched_modules():
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import (
        routed_experts as routed_experts_partition,
    )
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import (
        strict_expert_loading,
    )
    from vllm_kimi_k3_moe.model_executor.model_loader import default_loader
    from vllm_kimi_k3_moe.models.kimi_k3.nvidia import model

    return [
        (model, NVIDIA_MODEL, lambda m: m.KimiMoE),
        (strict_expert_loading, NVIDIA_MODEL, lambda m: m.KimiMoE),
        (
            routed_experts_partition,
            vllm_kimi_k3_moe.ROUTED_EXPERTS,
            lambda m: m.RoutedExperts.__dict__["_get_quant_method"],
        ),
        (
            default_loader,
            vllm_kimi_k3_moe.DEFAULT_LOADER,
            lambda m: m.DefaultModelLoader.__dict__["get_all_weights"],
        ),
    ]


@pytest.mark.parametrize(
    "index", range(4), ids=["model", "strict", "partition", "loader"]
)
def test_each_patch_applies_once_and_reverts_to_upstream(kimi_model, index):
    patch, module_name, patched_object = _patched_modules()[index]
    upstream = importlib.import_module(module_name)
    applied = patched_object(upstream)
    try:
        patch.revert(upstream)
        original = patched_object(upstream)
        assert original is not applied
        patch.revert(upstream)  # reverting twice changes nothing
        assert patched_object(upstream) is original
        patch.apply(upstream)
        again = patched_object(upstream)
        assert again is not original
        patch.apply(upstream)  # applying twice wraps once
        assert patched_object(upstream) is again
    finally:
        patch.revert(upstream)
        patch.apply(upstream)


def test_padding_and_strict_loading_are_independent_patches(kimi_model):
    """Deleting the padding patch (as when vLLM ships the fix) keeps strict
    loading, and the other way round: each patch adds and removes only its
    own layer of ``KimiMoE``."""
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import (
        strict_expert_loading,
    )
    from vllm_kimi_k3_moe.models.kimi_k3.nvidia import model

    strict = strict_expert_loading.StrictlyLoadedKimiMoE
    try:
        model.revert(kimi_model)
        assert issubclass(kimi_model.KimiMoE, strict)
        assert not issubclass(kimi_model.KimiMoE, BackendPaddedKimiMoE)
        strict_expert_loading.revert(kimi_model)
        assert kimi_model.KimiMoE is upstream_class(kimi_model.KimiMoE)
        model.apply(kimi_model)
        assert issubclass(kimi_model.KimiMoE, BackendPaddedKimiMoE)
        assert not issubclass(kimi_model.KimiMoE, strict)
    finally:
        model.apply(kimi_model)
        strict_expert_loading.apply(kimi_model)
    assert issubclass(kimi_model.KimiMoE, strict)
    assert issubclass(kimi_model.KimiMoE, BackendPaddedKimiMoE)


def test_kimi_moe_builds_under_a_config_that_only_stands_in(kimi_model, rank_config):
    """vLLM's own unit tests build layers under a config of their own, not a
    ``VllmConfig`` (a namespace of what the layer reads): the plugin builds
    ``KimiMoE`` from it wherever vLLM alone does, its fix and strict loading
    on (MXFP4 on Marlin at TP32: 128 rows per GPU, vLLM alone 256)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from tests.models.kimi_k3.builders import routed_experts
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading import (
        expert_loading,
    )

    real = rank_config(Topology(32))
    stand_in = SimpleNamespace(**{f: getattr(real, f) for f in vars(real)})
    rows = {}
    for i, upstream in enumerate((True, False)):
        cls = upstream_class(kimi_model.KimiMoE) if upstream else kimi_model.KimiMoE
        with set_current_vllm_config(stand_in), torch.device("meta"):
            moe = cls(
                kimi_k3_text_config(),
                stand_in,
                quant_config=real.quant_config,
                prefix=f"model.layers.{i + 1}.block_sparse_moe",
            )
        experts = routed_experts(moe)
        rows[upstream] = experts.w13_weight.shape[1] // 2
        assert (expert_loading(experts) is not None) is not upstream
    assert rows == {True: 256, False: 128}
