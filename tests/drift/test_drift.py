"""The plugin on vLLMs it was not verified on: copies of the installed vLLM
changed as future releases change code (``copies``), each run in a child
process as ``vllm serve`` would load the plugin (``in_copy``).

For every case: every format builds wherever vLLM alone builds it, never
larger; where the padding fix is on (or already in vLLM) each format's
partition is the regression suite's and FP8 block's forward at TP32 is
right; where the plugin stepped aside, nothing is patched and exactly one
warning line says what differed. About a minute per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.drift.copies import DRIFTS, Drift, drifted_copy
from tests.drift.in_copy import FIRST
from tests.fixes_on import fixes_on
from tests.model_info_cache import seeded_cache_root
from upstream.project_helpers import PARTITIONS
from upstream.verify_patch import PATCHED_CACHE_ROOT

REPO = Path(__file__).parents[2]
PATCH = "vllm_kimi_k3_moe."
MODEL = f"{PATCH}models.kimi_k3.nvidia.model"
PARTITION = f"{PATCH}model_executor.layers.fused_moe.routed_experts"
STRICT = f"{PATCH}model_executor.layers.fused_moe.strict_expert_loading"
LOADER = f"{PATCH}model_executor.model_loader.default_loader"
INT_WNA16 = f"{PATCH}model_executor.layers.fused_moe.oracle.int_wna16"
# the fixes of an update that does not finish, and of load plans (vLLM's
# reload code, which the in-tree patch leaves as it is; the copies keep the
# installed release's code, so without those 0.33 lacks)
UPDATES = fixes_on(
    [
        f"{PATCH}model_executor.model_loader.reload.{name}"
        for name in ("layerwise", "direct", "plan")
    ]
    + [
        f"{PATCH}model_executor.models.utils",
        f"{PATCH}distributed.weight_transfer.base",
    ]
)
EVERY_FIX_IN_ORDER = [MODEL, PARTITION, STRICT, LOADER, INT_WNA16, *UPDATES]  # PATCHES'
EVERY_FIX = sorted(EVERY_FIX_IN_ORDER)

# drift -> (fixes applied, the one line's level, words the line holds)
EXPECTED = {
    "release": (EVERY_FIX, "INFO", ["verified on this vLLM (0.35.0)"]),
    "nightly-renamed": (
        [],
        "WARNING",
        ["nothing patched", "0.34.1.dev57+gdeadbee", "_get_quant_method"],
    ),
    "signature-changed": ([], "WARNING", ["nothing patched", "get_all_weights"]),
    "module-moved": ([], "WARNING", ["nothing patched", "int_wna16"]),
    "in-tree": (
        sorted([STRICT, LOADER, *UPDATES]),
        "INFO",
        ["already in vLLM, not applied: model", "routed_experts", "int_wna16"],
    ),
    "nightly-commented": (
        EVERY_FIX,
        "INFO",
        [
            "verified on this vLLM (0.34.1.dev57+gdeadbee)",
            "proven on a small layer of this deployment",
            "CompressedTensorsW8A8Fp8MoEMethod, triton, 32 GPUs",
        ],
    ),
    "nightly-class-call": (
        [],
        "WARNING",
        ["nothing patched", "0.34.1.dev57+gdeadbee", "did not hold", "w13_"],
    ),
}
# The regression suite's partitions at TP16 and TP32 (ALIGNED_TOPOLOGIES)
RIGHT = {
    f"{fmt} | {backend} | TP{tp}": partitions[index]
    for fmt, backend, partitions in PARTITIONS
    for tp, index in ((16, 1), (32, 3))
}


def run_on(drift: Drift, root: Path) -> dict:
    copy = drifted_copy(drift, root)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(REPO)])
    # vLLM's model-info cache (tests.model_info_cache): the in-tree copy's
    # Kimi-K3 package is the one verify_patch's patched steps run, whose entry
    # they keep under PATCHED_CACHE_ROOT (one inspection of it, about 15 s,
    # for both tests); every other copy's is the installed one's
    if drift.in_tree:
        env["VLLM_CACHE_ROOT"] = str(PATCHED_CACHE_ROOT)
    else:
        env["VLLM_CACHE_ROOT"] = str(seeded_cache_root(root.parent / "vllm-cache"))
    if drift.first is not None:
        env[FIRST] = drift.first
    child = subprocess.run(
        [sys.executable, "-m", "tests.drift.in_copy"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert Path(report["vllm_file"]).is_relative_to(copy)  # the copy ran
    return report


@pytest.mark.slow
@pytest.mark.parametrize("drift", DRIFTS, ids=[d.name for d in DRIFTS])
def test_the_plugin_on_a_drifted_vllm(drift: Drift, tmp_path: Path) -> None:
    report = run_on(drift, tmp_path / "vllm-copy")
    applied, level, words = EXPECTED[drift.name]
    if drift.name == "release":
        words = [f"verified on this vLLM ({drift.version})"]
    assert report["applied"] == applied

    (line,) = report["lines"]  # exactly one line, whatever the case
    assert line[0] == level
    for word in words:
        assert word in line[1], line[1]
    # doctor's verdict is the plugin's, fix by fix (where the first layer
    # proves the fixes, doctor's says so: it builds none)
    doctor = report["doctor"]
    if drift.first is None:
        assert doctor["line"] == line[1]
        on = [f.split(":")[0].split()[-1] for f in doctor["fixes"] if f[:3] == "on "]
        assert on == [
            patch.rsplit(".", 1)[-1] for patch in EVERY_FIX_IN_ORDER if patch in applied
        ]
    else:
        assert "proven on a small layer" in doctor["line"], doctor["line"]
        # the deployment's own first layer: the fix's, or vLLM alone's exactly
        if applied:
            assert report["first"] == RIGHT[drift.first]
        else:
            assert report["first"] == report["first_alone"]

    with_plugin, alone = report["with_plugin"], report["alone"]
    for case, partition in alone.items():
        if isinstance(partition, int):  # vLLM alone builds it
            assert isinstance(with_plugin[case], int), (case, with_plugin[case])
            assert with_plugin[case] <= partition, case
    if PARTITION in applied or drift.in_tree:  # the fix is on, or vLLM's own
        assert with_plugin == RIGHT
        assert with_plugin["fp8-block | triton | TP32"] == 128
        assert report["forward_ok"]
    else:  # stepped aside whole: vLLM alone's layers, exactly
        assert report["form"] == "vllm"
        assert with_plugin == alone
