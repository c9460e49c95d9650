"""The layouts the advisor marks as run in public are layouts it lists: each
one vLLM builds for the release, on a GPU kind ``plan --gpu`` knows."""

from __future__ import annotations

import pytest

from vllm_kimi_k3_moe.tools.deployment.gpus import ALL_GPU_PRESETS
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import layouts
from vllm_kimi_k3_moe.tools.plan.public_layouts import PUBLIC_LAYOUTS, public_layouts


@pytest.mark.parametrize("gpu", PUBLIC_LAYOUTS)
def test_each_public_layout_is_one_the_advisor_lists(gpu):
    assert gpu in ALL_GPU_PRESETS
    for layout in PUBLIC_LAYOUTS[gpu]:
        gpus = layout.topology.gpus
        assert layout.topology in layouts(gpus, KIMI_K3_TEXT_CONFIG)
        assert layout in public_layouts(gpu.upper(), gpus)


def test_only_the_gpu_count_asked_and_none_without_a_preset():
    assert [x.topology.label() for x in public_layouts("b300", 8)] == [
        "TP8",
        "TP8 DCP8",
    ]
    assert public_layouts("b300", 16) == ()
    assert public_layouts(None, 8) == ()


def test_the_public_amd_layout_is_tp8_on_8_mi355x_as_its_sources_serve_it():
    """vLLM's recipe (MI355X verified, AITER on), ROCm/MAD PR 182 and
    InferenceX PR 2351 serve the release as TP8 on one node of 8 MI355X."""
    (layout,) = public_layouts("mi355x", 8)
    assert layout.topology.label() == "TP8"
    assert "AITER on" in layout.source and "MAD" in layout.source
    assert layout.flags == "--gpu-memory-utilization 0.95"
    assert public_layouts("mi300x", 16) == ()
