"""Beside other code that patches vLLM (RL frameworks, other plugins): a
wrapper of one of the plugin's targets, on vLLM code the plugin was
verified on, is told from changed code (``verification.targets``: the
installed source, and the object vLLM calls now); the fixes go on through
it once a small layer proves them with it in place, or the plugin steps
aside whole naming it; a wrapper installed after the plugin keeps the fixes
working; ``doctor`` names what other plugins replace. The wrappers are
``other_patches``'s, installed as such code installs them."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest

import vllm_kimi_k3_moe
from tests.fixes_on import fixes_on
from tests.models.kimi_k3 import other_patches as other
from tests.models.kimi_k3.forward_cases import CPU, TOLERANCE, layer_cache, small_case
from tests.models.kimi_k3.preparation.online import PATHS, quantize_rank, what_is_wrong
from tests.models.kimi_k3.preparation.test_online_quantization import bf16_problems
from tests.models.kimi_k3.test_small_layer_proof import RIGHT, build, plugin_lines
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import first_layer
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading import (
    expert_loading,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
from vllm_kimi_k3_moe.tools.selftest.harness import deployment_outputs, errors_of
from vllm_kimi_k3_moe.verification import report, targets, verdict

TP32 = Topology(32)
PARTITION_PATCH = vllm_kimi_k3_moe.PARTITION_PATCH
# every format the small-layer proof knows, each on a kernel it runs on
FORMATS = [
    ("fp8-block", "triton"),
    ("mxfp4", "marlin"),
    ("nvfp4", "cutlass"),
    ("w4a16", "marlin"),
    ("awq", "marlin"),
    ("bf16", "triton"),
]
# the two: the loader's weight iterator (same parameters, no
# functools.wraps) and the reload's materialisation (another signature)
OBSERVING = (other.observing_get_all_weights, other.observing_materialize)


@pytest.fixture
def registered_after(fresh_registration, monkeypatch):
    """Install wrappers, then register the plugin (its log captured, INFO
    too): the wrappers were there before it judged vLLM."""

    def register(*makes: Any) -> list[str]:
        installed = [other.install(monkeypatch, make) for make in makes]
        fresh_registration.set_level(logging.INFO, vllm_kimi_k3_moe.logger.name)
        other.Calls.clear()
        vllm_kimi_k3_moe.register()
        return installed

    return register


def _named(make: Any) -> str:
    module, path = other.WHERE[make]
    return f"{module.rsplit('.', 1)[-1]}.{path} by {other.name_of(make)}"


@pytest.mark.parametrize("make", list(other.WHERE), ids=lambda m: m.__name__)
def test_a_replaced_target_of_verified_code_is_named_not_called_changed(
    kimi_model, fresh_registration, monkeypatch, make
):
    target = other.install(monkeypatch, make)
    assert targets.replacement(target) == other.name_of(make)
    patch = next(
        p
        for _, p in vllm_kimi_k3_moe.PATCHES
        if target in importlib.import_module(p).TARGETS
    )
    judged = verdict.judge(patch)
    assert judged.state == verdict.REPLACED
    assert judged.detail.startswith("the code of vLLM ")
    assert judged.replaced == ((target, other.name_of(make)),)
    assert judged.applies


@pytest.mark.parametrize(("fmt", "backend"), FORMATS, ids=str)
def test_observing_wrappers_before_the_plugin_keep_every_fix_on(
    kimi_model, registered_after, fresh_registration, fmt, backend
):
    registered_after(*OBSERVING)
    assert first_layer.owed()  # verified code, replaced: proven first
    experts = build(kimi_model, fmt, backend, TP32)

    (record,) = plugin_lines(fresh_registration)
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "replaced at run time by other code: " in message
    assert all(_named(make) in message for make in OBSERVING), message
    assert "proven on a small layer of this deployment" in message
    assert "updated in place" in message
    # the proof's in-place update went through the replacement
    assert other.Calls["materialize_meta_tensor"] > 0
    judged = vllm_kimi_k3_moe.patches_judged_with(vllm_kimi_k3_moe._judged_models)
    assert set(vllm_kimi_k3_moe._decided[0]) == set(fixes_on(judged))
    assert experts.intermediate_size_per_partition == RIGHT[fmt, backend, TP32]
    assert expert_loading(experts) is not None


def test_wrappers_of_every_shape_before_the_plugin(
    kimi_model, registered_after, fresh_registration
):
    """``functools.wraps``, ``*args``, a plain function returning vLLM's
    generator, a wrapper that fills what vLLM materialises."""
    makes = (
        other.wrapped_get_all_weights,
        other.filling_materialize,
        other.wrapped_to_meta,
        other.observing_get_quant_method,
    )
    registered_after(*makes)
    experts = build(kimi_model, "fp8-block", "triton", TP32)

    (record,) = plugin_lines(fresh_registration)
    assert record.levelno == logging.INFO
    assert all(_named(make) in record.getMessage() for make in makes)
    assert other.Calls["to_meta_tensor"] and other.Calls["_get_quant_method"]
    assert experts.intermediate_size_per_partition == 128
    assert expert_loading(experts) is not None


def test_a_method_quantizing_while_loading_too(kimi_model, registered_after):
    """MXFP4 quantized from a BF16 checkpoint while vLLM loads it (whose
    loading materialises every expert tensor through ``reload.meta``):
    the smallest partition, the rows quantized those loaded, pads zero."""
    registered_after(*OBSERVING)
    path = next(p for p in PATHS if p.name == "mxfp4")
    quantized = quantize_rank(kimi_model, path, "marlin", Rank(TP32))
    assert vllm_kimi_k3_moe._decided[0]  # proven: the fixes stayed on
    assert quantized.experts.intermediate_size_per_partition == 128
    assert bf16_problems(quantized) == []
    assert what_is_wrong(quantized) == []


def test_fp8_block_computes_right_at_tp32_beside_the_wrappers(
    kimi_model, registered_after, tmp_path_factory
):
    registered_after(*OBSERVING)
    case = small_case("fp8-block", TP32)
    layer = layer_cache(lambda name: tmp_path_factory.mktemp(name))(case)
    outputs = deployment_outputs(CPU, case, kimi_model, layer)
    assert not first_layer.owed()
    assert vllm_kimi_k3_moe._decided[0]  # the fixes stayed on
    errors = errors_of(outputs, layer)  # by tokens in the batch
    assert errors and all(e < TOLERANCE for e in errors.values()), errors


def test_a_wrapper_that_breaks_what_the_fixes_rely_on_steps_aside_whole(
    kimi_model, registered_after, fresh_registration
):
    registered_after(other.dropping_materialize)
    experts = build(kimi_model, "fp8-block", "triton", TP32)

    warnings = [
        r for r in plugin_lines(fresh_registration) if r.levelno >= logging.WARNING
    ]
    (record,) = warnings
    message = record.getMessage()
    assert "nothing patched" in message and "did not hold" in message
    assert other.name_of(other.dropping_materialize) in message
    assert "meta.materialize_meta_tensor" in message
    assert "weight_loader" in message and "\n" not in message
    assert vllm_kimi_k3_moe._decided[0] == ()
    # the layer being built is vLLM alone's: 256 rows, no strict loading
    assert experts.intermediate_size_per_partition == 256
    assert expert_loading(experts) is None


def test_wrappers_after_the_plugin_keep_the_fixes_and_outlive_it(
    kimi_model, fresh_registration, monkeypatch
):
    """Other code imported after vLLM built its first layer wraps what the
    plugin wrapped: the plugin's wrapper runs inside it; unregistering
    leaves that code's wrapper working (on vLLM alone's path), registering
    again puts the fixes back through it."""
    from vllm.model_executor.layers.fused_moe import routed_experts

    vllm_kimi_k3_moe.register()
    assert not first_layer.owed()  # verified, nothing replaced yet
    for make in (
        other.observing_get_quant_method,
        other.wrapped_get_all_weights,
        other.observing_materialize,
    ):
        other.install(monkeypatch, make)
    other.Calls.clear()
    assert (
        build(kimi_model, "fp8-block", "triton", TP32).intermediate_size_per_partition
        == 128
    )
    assert other.Calls["_get_quant_method"] == 1

    vllm_kimi_k3_moe.unregister()
    theirs = routed_experts.RoutedExperts._get_quant_method
    assert targets.name_of(theirs) == other.name_of(other.observing_get_quant_method)
    alone = build(kimi_model, "fp8-block", "triton", TP32)
    assert alone.intermediate_size_per_partition == 256
    assert expert_loading(alone) is None
    assert other.Calls["_get_quant_method"] == 2

    vllm_kimi_k3_moe.register()  # judged now with the wrappers in place
    assert first_layer.owed()
    again = build(kimi_model, "fp8-block", "triton", TP32)
    assert routed_experts.RoutedExperts._get_quant_method is theirs
    assert again.intermediate_size_per_partition == 128
    assert expert_loading(again) is not None


def test_on_unverified_code_a_replacement_must_lead_back_to_vllm_s_own(
    kimi_model, fresh_registration, monkeypatch
):
    other_code = {
        release: {patch: {**code, "digest": "0" * 16} for patch, code in fixes.items()}
        for release, fixes in verdict.VERIFIED_CODE.items()
    }
    monkeypatch.setattr(verdict, "VERIFIED_CODE", other_code)
    other.install(monkeypatch, other.observing_materialize)
    calling_on = verdict.judge(PARTITION_PATCH)
    assert calling_on.state == verdict.CHECKED
    assert calling_on.replaced[0][1] == other.name_of(other.observing_materialize)

    other.install(monkeypatch, other.dropping_materialize)
    judged = verdict.judge(PARTITION_PATCH)
    assert judged.state == verdict.DIFFERS
    assert other.name_of(other.dropping_materialize) in judged.detail
    assert "does not lead back to vLLM's own" in judged.detail


def test_doctor_names_what_the_environment_s_plugins_replace(
    kimi_model, fresh_registration, monkeypatch
):
    """``verification.report`` (doctor's child) loads vLLM's general plugins
    before judging: a plugin that wraps a target is named."""
    import vllm.plugins

    def load_general_plugins() -> None:  # an RL framework's plugin
        other.install(monkeypatch, other.observing_get_all_weights)

    monkeypatch.setattr(vllm.plugins, "load_general_plugins", load_general_plugins)
    found = report.report()
    assert found["replaced"] == [_named(other.observing_get_all_weights)]
    (line,) = [f for f in found["fixes"] if " default_loader: " in f]
    assert line.startswith("on  default_loader: replaced at run time, the code")
    assert not found["nothing_patched"]
    assert "proven on a small layer" in found["line"]


def test_a_replacement_after_the_plugin_that_drops_its_wrapper_steps_it_aside(
    kimi_model, fresh_registration, monkeypatch
):
    """Other code that saved vLLM's method before the plugin patched and puts
    it back later (or replaces it without calling on what it replaced):
    the next Kimi-K3 layer finds the plugin's wrapper gone, and the plugin
    steps aside whole rather than leave half its fixes on."""
    from vllm.model_executor.layers.fused_moe import routed_experts

    saved = routed_experts.RoutedExperts._get_quant_method  # before the plugin
    vllm_kimi_k3_moe.register()
    assert (
        build(kimi_model, "fp8-block", "triton", TP32).intermediate_size_per_partition
        == 128
    )
    monkeypatch.setattr(routed_experts.RoutedExperts, "_get_quant_method", saved)
    experts = build(kimi_model, "fp8-block", "triton", TP32)

    (record,) = plugin_lines(fresh_registration)
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "RoutedExperts._get_quant_method was replaced after the plugin" in message
    assert f"{routed_experts.__name__}.RoutedExperts._get_quant_method" in message
    assert vllm_kimi_k3_moe._decided[0] == ()
    assert experts.intermediate_size_per_partition == 256  # vLLM alone's
    assert expert_loading(experts) is None
