"""Run in a child process whose ``PYTHONPATH`` puts a drifted vLLM copy first
(``tests.drift.copies``): what the plugin decided there, and what every
format builds with it and with vLLM alone, as JSON on stdout::

    python -m tests.drift.in_copy

vLLM loads its general plugins as every process ``vllm serve`` starts does,
then imports its Kimi-K3 model (the plugin judges its fixes then). Each
row of the regression suite's partition table (format, backend) is built at
TP16 and TP32 at Kimi-K3's size on ``meta``, first as the plugin left vLLM,
then with the plugin unregistered (vLLM alone: every patch reverted), where
it applied any. Where
the plugin's padding is on, FP8 block at TP32 runs vLLM's MoE forward on
every rank, summed against the unsharded experts.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

TOPOLOGIES = (16, 32)  # where vLLM alone pads to 256 and the fix matters
FIRST = "DRIFT_FIRST"  # "format | backend | TPn": the deployment, built first


class Lines(logging.Handler):
    """The plugin's log lines but the per-method partition lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("vllm-kimi-k3-moe: Kimi-K3 routed experts on"):
            self.lines.append((record.levelname, message))


def build(model: Any, key: str) -> Any:
    """Rank 0's partition of ``key`` ("format | backend | TPn"), or the error
    raised."""
    from upstream import partition_matrix as matrix
    from upstream import project_helpers as helpers

    fmt, backend, tp = key.split(" | ")
    topology = helpers.Topology(int(tp.removeprefix("TP")))
    try:
        experts = matrix.build_experts(model, fmt, backend, topology, small=False)
        return experts.intermediate_size_per_partition
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def builds(model: Any) -> dict[str, Any]:
    """Rank 0's partition per (format, backend, TP), or the error raised."""
    from upstream import project_helpers as helpers

    return {
        key: build(model, key)
        for fmt, backend, _ in helpers.PARTITIONS
        for key in (f"{fmt} | {backend} | TP{tp}" for tp in TOPOLOGIES)
    }


def fp8_block_forward_errors(model: Any) -> dict[str, float]:
    """vLLM's MoE forward at TP32, FP8 block, every rank summed, against the
    unsharded experts: each output's error."""
    from tests.models.kimi_k3 import forward_cases as forward
    from vllm_kimi_k3_moe.tools.deployment.topology import Topology
    from vllm_kimi_k3_moe.tools.selftest.harness import deployment_outputs, errors_of

    case = forward.small_case("fp8-block", Topology(32))
    with tempfile.TemporaryDirectory() as work:
        layer = forward.prepare_layer(case, forward.CPU, Path(work))
        output = deployment_outputs(forward.CPU, case, model, layer)
        errors = errors_of(output, layer)
    return {"tolerance": forward.TOLERANCE, **{k: float(v) for k, v in errors.items()}}


def applied_now() -> list[str]:
    """The fixes the plugin has on now (none once it stepped aside)."""
    import vllm_kimi_k3_moe

    on = vllm_kimi_k3_moe._decided[0]
    return sorted({patch for _, patch in vllm_kimi_k3_moe.PATCHES if patch in on})


def main() -> int:
    import vllm.version
    from vllm.plugins import load_general_plugins

    import vllm_kimi_k3_moe
    from upstream import partition_matrix as matrix
    from upstream import project_helpers as helpers
    from vllm_kimi_k3_moe.verification.report import report as verification_report

    torch.set_num_threads(1)
    lines = Lines()
    vllm_kimi_k3_moe.logger.addHandler(lines)
    vllm_kimi_k3_moe.logger.setLevel(logging.INFO)
    load_general_plugins()
    model = importlib.import_module(matrix.KIMI_K3_NVIDIA_MODEL)
    report: dict[str, Any] = {
        "version": vllm.version.__version__,
        "vllm_file": vllm.__file__,
        "lines": lines.lines,
        "applied": applied_now(),
        "form": matrix.form(model),
        # what doctor prints on this vLLM (judged again, after the plugin's)
        "doctor": verification_report(),
    }
    first = os.environ.get(FIRST)
    with helpers.moe_kernels_on_their_gpu():
        if first:  # the deployment: its first layer proves unverified code
            report["first"] = build(model, first)
            report["applied"] = applied_now()
            report["form"] = matrix.form(model)
        report["with_plugin"] = builds(model)
        if report["form"] == "plugin":
            errors = fp8_block_forward_errors(model)
            report["forward_ok"] = all(
                math.isfinite(v) and v < errors["tolerance"]
                for k, v in errors.items()
                if k != "tolerance"
            )
        if report["applied"]:
            vllm_kimi_k3_moe.unregister()
            report["alone"] = builds(model)
        else:  # nothing went on: these were vLLM alone's builds
            report["alone"] = report["with_plugin"]
        if first:
            vllm_kimi_k3_moe.unregister()
            report["first_alone"] = build(model, first)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
