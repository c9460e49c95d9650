"""Each fix declares the upstream objects it touches; on the installed vLLM
(a verified release) every one is judged verified by the code recorded for
it, the same before and after the plugin patched; the decision is all or
nothing. The drifted vLLMs are ``tests/drift``'s."""

from __future__ import annotations

import importlib
from importlib.metadata import version

import pytest

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.verification import targets, verdict
from vllm_kimi_k3_moe.verification.verified_code import VERIFIED_CODE

PATCH_MODULES = list(dict.fromkeys(patch for _, patch in vllm_kimi_k3_moe.PATCHES))
INSTALLED = version("vllm")


def _has_its_code(patch: str) -> bool:
    """Whether this vLLM has the code ``patch`` is for (``ONLY_WHERE``)."""
    only_where = getattr(importlib.import_module(patch), "ONLY_WHERE", None)
    return only_where is None or verdict.has_module(only_where)


@pytest.mark.parametrize("patch", PATCH_MODULES)
def test_every_patch_declares_targets_recorded_on_this_release(kimi_model, patch):
    """A patch added later is covered once it declares ``TARGETS`` and
    ``python -m vllm_kimi_k3_moe.verification.record`` ran on each verified
    release."""
    declared = importlib.import_module(patch).TARGETS
    assert declared and all(":" in t for t in declared)
    if not _has_its_code(patch):
        assert patch not in VERIFIED_CODE[INSTALLED]
        return
    recorded = VERIFIED_CODE[INSTALLED][patch]
    assert recorded["digest"] == targets.digest(declared), "run record"
    assert len(recorded["signatures"]) == len(declared)


@pytest.mark.parametrize("patch", PATCH_MODULES)
def test_every_fix_is_verified_and_lacking_in_this_vllm(kimi_model, patch):
    """On a verified release each fix is verified by its code, what it relies
    on is there, and vLLM does not already do it."""
    module = importlib.import_module(patch)
    judged = verdict.judge(patch)
    if not _has_its_code(patch):  # vLLM 0.33 has no direct mode nor load plans
        assert judged.state == verdict.ABSENT and not judged.applies
        assert INSTALLED == "0.33.0", "only vLLM 0.33 lacks what a patch is for"
        return
    assert (judged.state, judged.detail) == (
        verdict.VERIFIED,
        f"the code of vLLM {INSTALLED}",
    )
    for check in ("relied_on", "in_vllm"):
        if hasattr(module, check):
            assert getattr(module, check)(targets.find) is None, check


def test_targets_are_found_as_upstream_defined_them(kimi_model):
    """The plugin is on in this process: its layered class and wrapped
    methods are seen through, to upstream's own objects."""
    from vllm_kimi_k3_moe.patching import is_plugin_wrapper, upstream_class

    init = targets.find("vllm.models.kimi_k3.nvidia.model:KimiMoE.__init__")
    assert init is upstream_class(kimi_model.KimiMoE).__init__
    name = "vllm.model_executor.layers.fused_moe.routed_experts"
    own = targets.find(f"{name}:RoutedExperts._get_quant_method")
    assert is_plugin_wrapper(routed_experts_module(name)._get_quant_method)
    assert not is_plugin_wrapper(own)
    assert own.__module__ == name
    assert targets.replacement(f"{name}:RoutedExperts._get_quant_method") is None
    with pytest.raises(targets.TargetMissing):
        targets.find(f"{name}:RoutedExperts._build_quant_method")
    with pytest.raises(targets.TargetMissing):
        targets.find("vllm.model_executor.layers.fused_moe.oracle.wna16:anything")


def routed_experts_module(name: str) -> type:
    return importlib.import_module(name).RoutedExperts


def _verdict(name: str, state: str, detail: str = "x") -> verdict.FixVerdict:
    return verdict.FixVerdict(f"pkg.{name}", state, detail)


def test_one_difference_patches_nothing_in_one_warning():
    verdicts = [
        _verdict("a", verdict.VERIFIED),
        _verdict("b", verdict.DIFFERS, "no vllm.m:C.f"),
        _verdict("c", verdict.CHECKED),
    ]
    decision = verdict.decide(verdicts, "9.9.9", plain=False)
    assert decision.apply == ()
    assert decision.warning
    assert "nothing patched on vLLM 9.9.9" in decision.line
    assert "b: no vllm.m:C.f" in decision.line


def test_fixes_in_vllm_stay_off_and_the_others_on():
    verdicts = [
        _verdict("a", verdict.IN_VLLM, "vLLM pads"),
        _verdict("b", verdict.CHECKED),
    ]
    decision = verdict.decide(verdicts, "9.9.9", plain=False)
    assert decision.apply == ("pkg.b",)
    assert not decision.warning
    assert "verified on this vLLM (9.9.9): b applied" in decision.line
    assert "already in vLLM, not applied: a (vLLM pads)" in decision.line


def test_a_verified_release_with_its_code_says_nothing():
    verdicts = [_verdict("a", verdict.VERIFIED), _verdict("b", verdict.VERIFIED)]
    assert verdict.decide(verdicts, "0", plain=True).line is None
    assert verdict.decide(verdicts, "0", plain=True).apply == ("pkg.a", "pkg.b")
    assert "verified on this vLLM" in verdict.decide(verdicts, "0", False).line
