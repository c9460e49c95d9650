"""Weights updated in a running server land as a fresh load of them would:
through vLLM's own update paths (``updates.PATHS``), twice in a row, every
rank holds byte for byte what a fresh build and load of the same weights
holds after its kernel prepared them, pads zero, with uninitialised memory
random; and the strict loader still refuses a broken checkpoint at the cold
start."""

from __future__ import annotations

import dataclasses
import json
import os
from types import ModuleType
from typing import Any

import pytest

from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.update_matrix import (
    LAYOUTS,
    TP8_EP,
    TP16_DP2,
    TP32,
    ranks_of,
)
from tests.models.kimi_k3.preparation.updates import (
    PATHS,
    differences,
    has_lifecycle,
    served_rank,
    snapshot,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import is_online
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import OnlineQuantization

UPDATES = (1, 2)  # weights B and C after A (0): two updates in a row


def _paths_of_this_vllm() -> list[str]:
    """The update paths this vLLM has: the public reload on both releases,
    the rest on 0.34."""
    return [p for p in PATHS if p == "reload_weights" or has_lifecycle()]


# Fresh loads already taken, by everything ``served_rank`` builds and loads
# from (``rows`` only labels a case) and the reload mode set: the update paths
# of one mode compare with the same fresh loads (seeded, byte for byte the
# same each time), taken once per process.
_FRESH: dict[tuple[Any, ...], dict[str, Any]] = {}


@pytest.fixture(autouse=True, scope="module")
def _fresh_loads_forgotten() -> Any:
    """The fresh loads kept for this file's tests, dropped after them."""
    yield
    _FRESH.clear()


def fresh_load(
    kimi_model: ModuleType,
    case: PreparationCase,
    version: int,
    online: OnlineQuantization | None,
    selection: Any,
) -> dict[str, Any]:
    """``snapshot`` of ``case``'s GPU freshly loaded with weights ``version``
    (uninitialised memory random, seeded by the version)."""
    key = (
        kimi_model.KimiMoE,
        dataclasses.replace(case, rows=0),
        version,
        online,
        selection,
        os.environ.get("VLLM_RELOAD_MODE"),
    )
    if key not in _FRESH:
        with served_rank(
            kimi_model, case, version, online, seed=100 + version, selection=selection
        ) as r:
            _FRESH[key] = snapshot(r.experts)
    return _FRESH[key]


def updated_like_fresh(
    kimi_model: ModuleType,
    case: PreparationCase,
    path: str,
    online: OnlineQuantization | None = None,
    selection: Any = None,
) -> list[str]:
    """What differs, after each update through ``path``, from a fresh load of
    the same weights on ``case``'s GPU (each loaded with other random
    bytes in memory nobody wrote; ``fresh_load``)."""
    fresh = {
        version: fresh_load(kimi_model, case, version, online, selection)
        for version in UPDATES
    }
    problems = []
    with (
        update_state() as state,
        served_rank(kimi_model, case, 0, online, seed=1, selection=selection) as served,
    ):
        assert is_online(served.experts.quant_method) == (online is not None)
        for version in UPDATES:
            PATHS[path](served, weights_of(served.layer, version), state)
            wrong = differences(snapshot(served.experts), fresh[version])
            if wrong:
                problems.append(
                    f"{case.label()}, update {version} through {path}: {wrong}"
                )
    return problems


@pytest.mark.parametrize(
    "path", [p for p in _paths_of_this_vllm() if p in ("reload_weights", "load_plan")]
)
def test_mxfp4_marlin_at_tp32_every_rank(kimi_model, reload_mode, path) -> None:
    """The released checkpoint on Marlin at TP32 (96 rows of 128 held), every
    one of the 32 GPUs, updated twice, through the two kinds of reload
    (layerwise; direct, as a load plan writes it): every path and what can
    happen to an update, at GPU 31, are ``test_update_matrix``'s."""
    reload_mode(path)
    problems = []
    for rank in range(32):
        case = PreparationCase("mxfp4", "marlin", TP32, rank, rows=96)
        problems += updated_like_fresh(kimi_model, case, path)
    assert not problems, "\n".join(problems)


# (config in kimi_k3_formats, --moe-backend): MXFP4 (the release), FP8 in
# [128, 128] blocks, NVFP4, INT4 in groups of 128 (AutoAWQ), all on Marlin
FORMATS = [
    ("mxfp4", "marlin"),
    ("fp8-block", "marlin"),
    ("nvfp4", "marlin"),
    ("awq", "marlin"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: t.label())
@pytest.mark.parametrize(("config", "backend"), FORMATS)
def test_updated_through_the_public_reload(
    kimi_model, reload_mode, config, backend, layout
) -> None:
    """GPUs of each layout, each format, updated twice through
    ``reload_weights`` (vLLM's layerwise reload on both releases)."""
    reload_mode("reload_weights")
    problems = []
    for rank in ranks_of(layout):
        case = PreparationCase(config, backend, layout, rank)
        problems += updated_like_fresh(kimi_model, case, "reload_weights")
    assert not problems, "\n".join(problems)


# Two online methods: BF16 trainer weights quantized as they load, at a
# layout with a pad (TP16 x DP2: 96 rows of each expert held)
ONLINE = [
    ("fp8_per_block", "triton"),
    ("fp8_per_tensor", "marlin"),
]


@pytest.mark.parametrize("path", _paths_of_this_vllm()[:2])
@pytest.mark.parametrize(("method", "backend"), ONLINE)
def test_bf16_updates_into_an_online_quantized_model(
    kimi_model, reload_mode, method, backend, path
) -> None:
    """BF16 weights pushed into a model quantized while it loaded come out
    as a fresh quantized load of them: re-quantized, pads zero."""
    reload_mode(path)
    online = OnlineQuantization("online", json.dumps({"moe": method}))
    problems = []
    for layout in (TP16_DP2, TP32):
        for rank in ranks_of(layout):
            case = PreparationCase("bf16", backend, layout, rank)
            problems += updated_like_fresh(kimi_model, case, path, online)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not has_lifecycle(), reason="EPLB's recovery is vLLM 0.34's")
def test_kimi_k3_gives_eplb_no_redundant_slots(kimi_model) -> None:
    """Why EPLB's recovery is tested with the placement kept: vLLM 0.34's
    Kimi-K3 builds no redundant expert slots even with ``--enable-eplb``
    asking for them (its ``KimiMoE`` hands ``FusedMoEFactory`` no
    ``num_redundant_experts``), so no recovery moves an expert into another
    slot. The day it does, this fails: then test the recovery into a moved
    placement (a dead GPU's experts re-hosted in spare slots), with vLLM's
    ``mark_dead_expert_slots_inplace`` and ``redistribute_expert_placement``."""
    case = PreparationCase("mxfp4", "marlin", TP8_EP, 0)
    with served_rank(kimi_model, case, redundant_experts=8) as served:
        assert served.vllm_config.parallel_config.enable_eplb
        config = served.experts.moe_config
        assert config.num_experts == config.num_logical_experts
