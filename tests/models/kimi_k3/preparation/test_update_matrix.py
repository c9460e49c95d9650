"""Whatever happens to an in-place update, through every update path the
installed vLLM has, the plugin ends right (``update_matrix``): a whole update,
in buckets, after a level-2 sleep or the weight checker's reset lands as a
fresh load; a partial one keeps the rest (layerwise) or is refused (direct);
a malformed tensor is refused; a source dying midway leaves the layer
serving what it held (layerwise), off ``meta``, in the same storage; and the
next whole update always lands. The cells here stand for each class of the
matrix ``python -m benchmarks.in_place_updates`` prints whole: every
scenario on every path at two GPUs, and on the two kinds of reload
(layerwise, direct) in every other format, at GPUs chosen so that each
format, each layout and each kind of GPU (a pad, no rows at all, whole
experts) is met."""

from __future__ import annotations

import pytest

from tests.models.kimi_k3.preparation.update_matrix import (
    DIRECT_PATHS,
    FORMATS,
    SCENARIO_NAMED,
    SCENARIOS,
    TP8_EP,
    TP16,
    TP16_DP2,
    TP32,
    cell,
    forget_fresh_loads,
    paths_of_this_vllm,
)

FORMAT = {f.label: f for f in FORMATS}

# (format, layout, GPU) where every scenario runs on every path: the release
# at TP32 holds 96 rows of 128 (a pad); FP8's whole blocks of 128 leave GPU
# 31 of TP32 no rows at all, and a load plan sends its scales through the
# loaders (cast to float32), the rest straight into memory
EVERY_PATH = [("mxfp4", TP32, 31), ("fp8-block", TP32, 31)]
# the other formats, each at a layout of its own, through the two kinds of
# reload (layerwise, and direct where vLLM takes the format there): NVFP4 at
# TP16 holds 192 of 256 rows; INT4 in groups of 128 across data
# parallelism; BF16 quantized to FP8 blocks while it loads, 96 rows of 128
OTHER_FORMATS = [
    ("nvfp4", TP16, 8),
    ("int4-awq", TP16_DP2, 0),
    ("bf16->fp8", TP16_DP2, 31),
]
# EPLB recovers expert-parallel layers only: each format, first or last GPU
EPLB = [(f.label, TP8_EP, 7 * (i % 2)) for i, f in enumerate(FORMATS)]


@pytest.fixture(autouse=True, scope="module")
def _fresh_loads_forgotten():
    """The fresh loads kept for this file's tests, dropped after them."""
    yield
    forget_fresh_loads()


def wrong_cells(kimi_model, path: str, chosen: list) -> list[str]:
    """Every scenario through ``path`` on the ``chosen`` GPUs: the cells
    that are not right."""
    wrong = []
    for label, layout, rank in chosen:
        for scenario in SCENARIOS:
            found = cell(kimi_model, FORMAT[label], layout, path, scenario, [rank])
            if found not in ("ok", "n/a"):
                wrong.append(f"{label} {layout.label()} {scenario.key}: {found}")
    return wrong


@pytest.mark.parametrize("path", paths_of_this_vllm())
def test_every_scenario_on_every_path(kimi_model, reload_mode, path) -> None:
    reload_mode(path)
    chosen = EPLB if path == "eplb_recovery" else EVERY_PATH
    wrong = wrong_cells(kimi_model, path, chosen)
    assert not wrong, "\n".join(wrong)


KINDS = [p for p in ("reload_weights", "load_plan") if p in paths_of_this_vllm()]


@pytest.mark.parametrize("path", KINDS)
def test_every_scenario_in_every_format(kimi_model, reload_mode, path) -> None:
    reload_mode(path)
    wrong = wrong_cells(kimi_model, path, OTHER_FORMATS)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", [p for p in DIRECT_PATHS if p in paths_of_this_vllm()])
def test_a_direct_update_sending_a_gpu_none_of_its_experts(
    kimi_model, reload_mode, path
) -> None:
    """Expert parallelism: B for experts 1 and 2 sends GPU 3 of TP8 (one
    expert a GPU in the small layer) nothing of the layer, and direct mode
    prepares every layer again at its finish, this one from its Marlin
    bytes read as a checkpoint's: refused, and B sent whole next lands."""
    reload_mode(path)
    experts = SCENARIO_NAMED["experts"]
    assert cell(kimi_model, FORMAT["mxfp4"], TP8_EP, path, experts, [3]) == "ok"
