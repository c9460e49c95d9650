"""vLLM's own Triton MoE kernel, run by Triton's interpreter at the
partitions the plugin gives every config that runs on it.

``--moe-backend triton`` builds ``TritonExperts`` for BF16 (the only NVIDIA
kernel that runs Kimi-K3's SiTU unquantized), FP8 in [128, 128] blocks with
per-token-group FP8 activations, and FP8 per output channel with per-token
activations (``CONFIGS``); INT8 and INT4 (WNA16) and MXFP4 it refuses for
Kimi-K3 (``test_triton_refuses_the_rest``). For each config, one GPU of
every distinct layout the never-worse matrix builds
(``harness.representatives``: the partition, the checkpoint rows the GPU
holds, expert parallelism) is built and loaded through the plugin with
memory nobody wrote reading NaN, prepared by vLLM, and run through
``TritonExperts``: ``fused_moe_kernel`` (``invoke_fused_moe_triton_kernel``)
and, for FP8, vLLM's Triton activation quantization
(``per_token_group_quant_fp8``), interpreted; only the CUDA-only ops around
them are stood in (``stand_ins.triton_moe_forward_on_cpu``, each checked in
``test_triton_stand_ins``). Each GPU's output must equal its share of the
unsharded experts (its rows of every expert, or its whole experts: the rows
the GPUs before it hold come first, ``harness.rows_held``), so the GPUs'
outputs summed are the unsharded experts (the sum itself is the forward-equivalence
proof's, on vLLM's reference kernel, over every rank; here a layout's GPUs
of equal layout differ only in which rows they load, which the share of
each checks).

Why a subprocess (``triton_interpreted_ranks``, once a session): Triton's
interpreter (``TRITON_INTERPRET=1``) is chosen when ``triton.jit`` decorates
a kernel, i.e. when vLLM's modules are imported, and vLLM turns Triton off
at import when no GPU driver is active unless ``CUDA_VISIBLE_DEVICES`` is
empty. A pytest process has imported vLLM for other tests long before this
module runs, and setting either variable for the whole suite would change
what every other test runs; a child process started with them set is the
one place both hold from its first import.

BF16 the interpreter computes wrong (3e11 where the answer is 4): the layers
run with an FP32 compute type (``InterpretedTriton``: BF16 parameters
widened exactly after vLLM prepared them, FP32 activations); FP8 layers run
FP8 inputs into FP32 sums, as on the GPU. The interpreter's FP32 -> FP8
cast loses the carry of a round-up (127 -> 64): it is redone as a GPU rounds
(``stand_ins.triton_on_cpu._narrowing_float_cast``), so vLLM's Triton activation
quantization hands the GEMM what it would on the GPU; the share rounds the
GEMMs' inputs to FP8 the same way, written from the format, not vLLM.

Pads: only FP8 in blocks has any at Triton's layouts (BF16 and FP8 per
channel allocate exactly the rows they load), and there vLLM's own
block-aligned loader (``tp_shard_with_padding``) writes 0 over each loaded
expert's pad (1 over its scales) before copying the checkpoint's rows, as
does the plugin's zero fill before loading: either alone keeps the pad zero
(``test_the_pads_the_kernel_reads_are_zero`` and the pad-only GPUs'
exactly-zero output fail only with both turned off).

Kept out, for CI's time (the interpreter runs one program at a time: a GPU
holding all 3072 rows of an expert costs a quarter of a minute): the
layouts whose GPUs hold more than ``MOST_ROWS`` rows (TP1, DP2, DP4 without
expert parallelism, and expert parallelism's whole experts). They pad
nothing and split no block; what their kernel reads is held to the kernel's
contract by ``preparation/test_triton`` (``triton_kernel.TritonGemm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.models.kimi_k3.preparation.harness import (
    PreparationCase,
    representatives,
    rows_held,
)
from tests.models.kimi_k3.test_never_worse_matrix import Built, outcome
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.selftest.interpreted_triton import (
    INTERPRETER_ENVIRONMENT,
)

pytestmark = [pytest.mark.triton_interpreted, pytest.mark.slow]

CONFIGS = ("bf16", "fp8-block", "ct-fp8-channel")
# Relative error a GPU's output may have against its share: FP32 arithmetic
# (BF16 layers), or, for FP8, what is left once the share rounds the GEMMs'
# inputs to FP8 as the kernel does (``as_fp8_activations``): a value near a
# rounding boundary (3 mantissa bits) the float64 share rounds the other way
# (measured: up to 0.024 for FP8 blocks, 0.016 per channel). The synthetic
# checkpoint's rows vary smoothly, so a GPU loading every row one place off
# errs by only 0.055-0.075 with FP8 blocks (0.09-0.4 in BF16, 0.6-0.8 per
# channel, whose per-row scales stay put): the FP8 bound sits between.
TOLERANCE = {"bf16": 1e-5, "fp8-block": 0.04, "ct-fp8-channel": 0.04}
MOST_ROWS = 384  # the module docstring: larger partitions are not run here
ROOT = Path(__file__).resolve().parents[3]
RUNNER = "tests.models.kimi_k3.triton_interpreted_ranks"


def _rows(case: PreparationCase, built: Built) -> tuple[int, int]:
    held = rows_held(built.choice, built.intermediate, case.topology)
    start = sum(held[: case.rank])
    return start, start + held[case.rank]


def _cases(format_experts: Any) -> dict[str, list[dict[str, Any]]]:
    """Per config, one JSON case per distinct layout (``representatives``)."""
    cases: dict[str, list[dict[str, Any]]] = {}
    for config in CONFIGS:
        cases[config] = []
        for case in representatives(format_experts, config, "triton"):
            built = outcome(format_experts, config, "triton", case.topology)
            if case.topology.expert_parallel or built.partition > MOST_ROWS:
                continue
            topology = case.topology
            cases[config].append(
                {
                    "label": case.label(),
                    "config": config,
                    "topology": {
                        "tp_size": topology.tp_size,
                        "dp_size": topology.dp_size,
                        "expert_parallel": topology.expert_parallel,
                    },
                    "rank": case.rank,
                    "rows": _rows(case, built),
                }
            )
    return cases


_RESULTS: dict[str, Any] = {}


@pytest.fixture
def interpreted(format_experts, tmp_path_factory) -> dict[str, Any]:
    """Every case's result, from one child process a session."""
    if not _RESULTS:
        cases = _cases(format_experts)
        output = tmp_path_factory.mktemp("triton-interpreted") / "results.json"
        environment = {**os.environ, **INTERPRETER_ENVIRONMENT}
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), environment.get("PYTHONPATH", "")]
        )
        subprocess.run(
            [sys.executable, "-m", RUNNER, str(output)],
            input=json.dumps([c for cs in cases.values() for c in cs]),
            text=True,
            env=environment,
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        _RESULTS["cases"] = cases
        _RESULTS["results"] = json.loads(output.read_text())
    return _RESULTS


@pytest.mark.parametrize("config", CONFIGS)
def test_each_gpu_computes_its_share_on_the_triton_kernel(interpreted, config):
    cases = interpreted["cases"][config]
    assert cases, f"{config}: no layout on Triton"
    wrong = []
    for case in cases:
        result = interpreted["results"][case["label"]]
        where = case["label"]
        if "failure" in result:
            wrong.append(f"{where}: {result['failure']}")
            continue
        assert "TritonExperts" in result["kernel"], (where, result["kernel"])
        assert "interpreted" in result["kernel"], (where, result["kernel"])
        if not result["error"] <= TOLERANCE[config]:
            wrong.append(f"{where}: relative error {result['error']:.3g}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("config", CONFIGS)
def test_the_pads_the_kernel_reads_are_zero(interpreted, config):
    """What the kernel multiplies through past a GPU's checkpoint rows (its
    prepared weights' rows ``[held, allocated)``) is zero, where memory
    nobody wrote reads NaN. BF16 and FP8 per channel have no such rows at
    any Triton layout (the partition is the GPU's even slice); FP8 in
    [128, 128] blocks holds whole blocks (vLLM's block-aligned loader,
    ``tp_shard_with_padding``), so the GPUs past the last block (TP32's
    24-31, TP16's 12-15, ...) hold only pad: their rows must read zero and
    their output be exactly zero (``test_each_gpu_computes_its_share``)."""
    cases = interpreted["cases"][config]
    padded = []
    for case in cases:
        result = interpreted["results"][case["label"]]
        if "failure" in result:
            continue  # reported by test_each_gpu_computes_its_share
        assert result["pad_nonzero"] == 0, (case["label"], result)
        padded += [case["label"]] if result["held"] < result["allocated"] else []
    # the claim is about real pads only where a layout has some
    assert bool(padded) == (config == "fp8-block"), (config, padded)


@pytest.mark.parametrize(
    "config", ["w4a16", "ct-int8-g128-sym", "gptq", "awq", "mxfp4", "ct-fp8-tensor"]
)
def test_triton_refuses_the_rest(format_experts, config):
    """INT4/INT8 (WNA16), native MXFP4 and compressed-tensors FP8 per tensor:
    vLLM builds none of them on Triton for Kimi-K3, with or without the
    plugin, so no Triton kernel runs them."""
    for upstream in (True, False):
        built = outcome(
            format_experts, config, "triton", Topology(1), upstream=upstream
        )
        assert not isinstance(built, Built), (config, built)
