"""Whatever happens to an in-place update, through every update path the
installed vLLM has, the plugin ends right (``update_matrix``): a whole update,
in buckets, after a level-2 sleep or the weight checker's reset lands as a
fresh load; a partial one keeps the rest (layerwise) or is refused (direct);
a malformed tensor is refused; a source dying midway leaves the layer
serving what it held (layerwise), off ``meta``, in the same storage; and the
next whole update always lands. The cells here stand for each class of the
matrix ``python -m benchmarks.in_place_updates`` prints whole: every
scenario on every path, at GPUs chosen so that each format, each layout and
each kind of GPU (a pad, no rows at all, whole experts) is met."""

from __future__ import annotations

import pytest

from tests.models.kimi_k3.preparation.update_matrix import (
    FORMATS,
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

# (format, layout, GPU): the release at TP32 holds 96 rows of 128 (a pad);
# FP8's whole blocks of 128 leave GPU 31 of TP32 no rows at all, and its
# scales reach a load plan's fallback (cast to float32); NVFP4 at TP16 holds
# 192 of 256; INT4 in groups of 128 across data parallelism; BF16 quantized
# to FP8 blocks while it loads, with expert parallelism (whole experts).
REPRESENTATIVES = [
    ("mxfp4", TP32, 31),
    ("fp8-block", TP32, 31),
    ("nvfp4", TP16, 8),
    ("int4-awq", TP16_DP2, 0),
    ("bf16->fp8", TP8_EP, 7),
]
# EPLB recovers expert-parallel layers only: every format on both ends
EPLB_REPRESENTATIVES = [(f.label, TP8_EP, rank) for f in FORMATS for rank in (0, 7)]


@pytest.fixture(autouse=True, scope="module")
def _fresh_loads_forgotten():
    """The fresh loads kept for this file's tests, dropped after them."""
    yield
    forget_fresh_loads()


@pytest.mark.parametrize("path", paths_of_this_vllm())
def test_every_scenario_on_every_path(kimi_model, reload_mode, path) -> None:
    """Every scenario through ``path``, on each representative GPU."""
    reload_mode(path)
    chosen = EPLB_REPRESENTATIVES if path == "eplb_recovery" else REPRESENTATIVES
    wrong = []
    for label, layout, rank in chosen:
        for scenario in SCENARIOS:
            found = cell(kimi_model, FORMAT[label], layout, path, scenario, [rank])
            if found not in ("ok", "n/a"):
                wrong.append(f"{label} {layout.label()} {scenario.key}: {found}")
    assert not wrong, "\n".join(wrong)
