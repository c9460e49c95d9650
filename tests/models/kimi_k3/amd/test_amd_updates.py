"""Weights updated in a running ROCm server land as a fresh load of them would,
through vLLM's own update paths: every GPU of TP32 on CDNA3 (vLLM's
emulation backend, 96 rows a GPU; vLLM alone raises there), updated twice,
holds byte for byte what a fresh build and load of the same weights holds
after its kernel prepared them, pads zero, memory nobody wrote random.
AITER's preparation (CDNA4) cannot run on a CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.models.kimi_k3.amd.conftest import on_an_amd_gpu
from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.test_in_place_updates import (
    _paths_of_this_vllm,
    updated_like_fresh,
)
from tests.models.kimi_k3.preparation.update_matrix import ranks_of
from tests.models.kimi_k3.preparation.updates import reload_mode_of
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

TP32 = Topology(32)
HELD_AT_TP32 = 3072 // 32


def on_an_mi300x(deployment: Any) -> Any:
    return on_an_amd_gpu("cdna3")


@pytest.mark.parametrize("path", _paths_of_this_vllm())
def test_updates_on_emulation_at_tp32(amd_model, monkeypatch, path) -> None:
    if path == "eplb_recovery":
        pytest.skip("EPLB reloads expert-parallel layers: not at TP32")
    monkeypatch.setenv("VLLM_RELOAD_MODE", reload_mode_of(path))
    problems = []
    for rank in ranks_of(TP32):
        case = PreparationCase("mxfp4", "auto", TP32, rank, rows=HELD_AT_TP32)
        problems += updated_like_fresh(amd_model, case, path, selection=on_an_mi300x)
    assert not problems, "\n".join(problems)
