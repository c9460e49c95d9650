"""An update that does not finish, for a reason of its own: what the plugin
says, where it acts and where it leaves things alone (the outcomes, byte for
byte, are ``test_update_matrix``'s)."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import pytest
import torch
from torch import nn

import vllm_kimi_k3_moe
from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.update_matrix import (
    TP32,
    cut_short,
    in_buckets,
    only,
)
from tests.models.kimi_k3.preparation.updates import (
    NO_FINISH,
    PATHS,
    RECEIVE_FAILS,
    DiesMidway,
    SourceDied,
    has_lifecycle,
    served_rank,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.patching import is_plugin_wrapper, own_function

GPU_31 = PreparationCase("mxfp4", "marlin", TP32, 31)
PLUGIN_LOG = "vllm.plugins.kimi_k3_moe"


def _on_meta(model: nn.Module) -> list[str]:
    return [name for name, t in model.named_parameters() if t.is_meta]


def test_a_source_dying_midway_says_what_the_engine_holds(
    kimi_model, reload_mode, caplog
) -> None:
    """The source's own exception reaches the caller, with a note (and one
    warning) saying what the engine holds: the layers the update had not
    finished, back as they were."""
    reload_mode("reload_weights")
    caplog.set_level(logging.WARNING, logger=PLUGIN_LOG)
    with update_state() as state, served_rank(kimi_model, GPU_31, 0) as served:
        b = weights_of(served.layer, 1)
        with pytest.raises(SourceDied) as died:
            PATHS["reload_weights"](served, [DiesMidway(b, len(b) // 2)], state)
        assert not _on_meta(served.model)
    said = (
        "vllm-kimi-k3-moe: the weight update failed (SourceDied): Kimi-K3 MoE "
        "layer 1 and "
    )
    assert any(note.startswith(said) for note in died.value.__notes__)
    assert [r.message for r in caplog.records if r.message.startswith(said)]


def test_an_engine_receive_failing_puts_back_at_once(kimi_model, reload_mode) -> None:
    """A weight-transfer engine's receive failing between two buckets (vLLM's
    IPC engine, its transport stood in): nothing of the loading is on the
    stack, and vLLM's worker ends the session there; the layers the update
    opened are given back what they held before the exception reaches the
    caller, with the note."""
    reload_mode("start_reload")
    with update_state() as state, served_rank(kimi_model, GPU_31, 0) as served:
        b = weights_of(served.layer, 1)
        with pytest.raises(SourceDied) as died:
            PATHS["start_reload"](served, [in_buckets(b, 2)[0], RECEIVE_FAILS], state)
        assert not _on_meta(served.model)
    assert any(
        "the weight update failed (SourceDied)" in n for n in died.value.__notes__
    )


def test_the_next_start_puts_back_an_update_left_open(
    kimi_model, reload_mode, caplog
) -> None:
    """An update abandoned between two buckets (no finish, no error: a
    trainer gone) leaves its layers open, as vLLM leaves a layer mid-update;
    the next update's start (every path's starts through
    ``initialize_layerwise_reload``) gives them back what they held first,
    and says so."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    reload_mode("start_reload")
    caplog.set_level(logging.WARNING, logger=PLUGIN_LOG)
    with update_state() as state, served_rank(kimi_model, GPU_31, 0) as served:
        b = weights_of(served.layer, 1)
        PATHS["start_reload"](served, [in_buckets(b, 2)[0], NO_FINISH], state)
        assert _on_meta(served.model), "vLLM left nothing open mid-update?"
        initialize_layerwise_reload(served.model)
    assert any(
        r.message.startswith(
            "vllm-kimi-k3-moe: an earlier weight update did not finish: Kimi-K3 "
            "MoE layer 1 and "
        )
        for r in caplog.records
    )


def test_another_model_in_the_process_is_left_alone(kimi_model, reload_mode) -> None:
    """A Kimi-K3 update that fails puts back its own model's layers, not
    another model's update under way in the same process (another engine's,
    a draft updated on its own)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    reload_mode("reload_weights")
    other = nn.Sequential(nn.Linear(4, 4))
    record_metadata_for_reloading(other)
    initialize_layerwise_reload(other)
    opened = _on_meta(other)
    assert opened
    with update_state() as state, served_rank(kimi_model, GPU_31, 0) as served:
        b = weights_of(served.layer, 1)
        with pytest.raises(ValueError, match="weight update refused"):
            PATHS["reload_weights"](served, [cut_short(b)], state)
        with pytest.raises(SourceDied):
            PATHS["reload_weights"](served, [DiesMidway(b, 3)], state)
        assert not _on_meta(served.model)
        assert _on_meta(other) == opened
        finalize_layerwise_reload(other, served.vllm_config.model_config)
    assert not _on_meta(other)


@pytest.mark.skipif(not has_lifecycle(), reason="load plans are vLLM 0.34's")
def test_a_load_plan_declaring_part_of_an_expert_is_refused(
    kimi_model, reload_mode
) -> None:
    """The NCCL engine plans from the metadata the trainer declares; one
    that leaves out an expert's w3 is refused when the plan is made, before
    any update is written through it, naming what is missing. Planned from
    the whole metadata, the next update lands."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    reload_mode("load_plan")
    with update_state() as state, served_rank(kimi_model, GPU_31, 0) as served:
        b = weights_of(served.layer, 1)
        state["metadata"] = [
            ParamMeta(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))
            for name, tensor in b.items()
            if ".experts.2.w3." not in name
        ]
        with pytest.raises(ValueError) as refused:
            PATHS["load_plan"](served, b, state)
        assert (
            "Kimi-K3 load plan refused: layer "
            "language_model.layers.1.block_sparse_moe.experts is declared in the "
            "plan's metadata with part of what its kernel keeps together (w1 and "
            "w3 with each of their tensors; w2 with each of its tensors): expert "
            "2 without w3.weight_packed, w3.weight_scale"
        ) in str(refused.value)
        del state["metadata"]
        PATHS["load_plan"](served, b, state)


@pytest.mark.skipif(not has_lifecycle(), reason="direct mode is vLLM 0.34's")
def test_direct_mode_counts_nothing_a_dead_update_sent(kimi_model, reload_mode) -> None:
    """In direct mode a source dying midway leaves the model mid-update (no
    rollback, by vLLM's design); the next update starts a new record of
    what is sent: sent two experts only, it is refused at its finish (the
    dead update's tensors of the others are not counted), and whole, it
    lands."""
    reload_mode("direct")
    with update_state() as state, served_rank(kimi_model, GPU_31, 0) as served:
        b = weights_of(served.layer, 1)
        with pytest.raises(SourceDied):
            PATHS["direct"](served, [DiesMidway(b, len(b) - 1)], state)
        with pytest.raises(ValueError, match="nothing of experts 0, 3"):
            PATHS["direct"](served, only(b, lambda e, p: e in (1, 2)), state)
        PATHS["direct"](served, b, state)


# The functions the update patches wrap, each where vLLM defines it
WRAPPED = {
    "vllm_kimi_k3_moe.model_executor.model_loader.reload.layerwise": (
        "vllm.model_executor.model_loader.reload.layerwise",
        "initialize_layerwise_reload",
    ),
    "vllm_kimi_k3_moe.model_executor.model_loader.reload.direct": (
        "vllm.model_executor.model_loader.reload.direct",
        "begin_direct_reload",
    ),
    "vllm_kimi_k3_moe.model_executor.model_loader.reload.plan": (
        "vllm.model_executor.model_loader.reload.plan",
        "plan_loads",
    ),
}


@pytest.mark.parametrize("patch", list(WRAPPED))
def test_every_module_binding_a_wrapped_function_is_patched(kimi_model, patch) -> None:
    """A start reached through any of vLLM's reload modules goes through the
    plugin: each module of the package that binds the function by name is
    one of the patch's sites (``vllm_kimi_k3_moe.PATCHES``), and holds the
    plugin's wrapper."""
    import vllm.model_executor.model_loader.reload as package

    defined_in, name = WRAPPED[patch]
    if importlib.util.find_spec(defined_in) is None:
        pytest.skip(f"this vLLM has no {defined_in}")
    upstream = own_function(getattr(importlib.import_module(defined_in), name))
    modules = [package.__name__] + [
        f"{package.__name__}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
    ]
    binding = [
        module
        for module in modules
        if own_function(getattr(importlib.import_module(module), name, None))
        is upstream
    ]
    sites = {site for site, p in vllm_kimi_k3_moe.PATCHES if p == patch}
    assert defined_in in binding and set(binding) <= sites
    for module in binding:
        assert is_plugin_wrapper(getattr(importlib.import_module(module), name))


def test_a_plain_tensor_is_no_load_plan_trace() -> None:
    from vllm_kimi_k3_moe.compat import load_plan_trace_name

    assert load_plan_trace_name(torch.zeros(2)) is None
