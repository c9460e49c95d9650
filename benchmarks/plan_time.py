"""Wall time of ``vllm-kimi-k3-moe plan`` and ``check --serve-command`` in fresh
processes, vLLM import included.

Times one configuration (``plan --tp 32``), the default TP8/16/32 table
(``plan``), the advisor over every layout of 32 H200s (``plan --gpus 32
--gpu h200``), ``check --serve-command`` on a release-sized header set (the
serve line read by vLLM's parser) and, for reference, the bare import of
vLLM's Kimi-K3 model that all of them pay. Each command runs as the tools
run it (humming's background builds off) and, alternating with it, as
before they turned them off (``HUMMING_DISABLE_PARALLEL_BUILD=0``, which the
tools keep): the pairs see the same load.

    python -m benchmarks.plan_time [RUNS]    # from the repo root
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_kimi_k3_moe.tools.cli.common import HUMMING_BACKGROUND_BUILDS

IMPORT = "import vllm.models.kimi_k3.nvidia.model"
SERVE_LINE = (
    "vllm serve {checkpoint} --tensor-parallel-size 8 "
    "--decode-context-parallel-size 8 --pipeline-parallel-size 2"
)
COMMANDS = {
    IMPORT: [sys.executable, "-c", IMPORT],
    "vllm-kimi-k3-moe plan --tp 32": ["plan", "--tp", "32"],
    "vllm-kimi-k3-moe plan": ["plan"],
    "vllm-kimi-k3-moe plan --gpus 32 --gpu h200": [
        "plan",
        "--gpus",
        "32",
        "--gpu",
        "h200",
    ],
    "vllm-kimi-k3-moe check --serve-command": ["check", "--serve-command", SERVE_LINE],
}
# HUMMING_DISABLE_PARALLEL_BUILD in the environments compared: the tools'
# own (unset: they turn the builds off themselves; the bare import is given
# "1") and the builds on ("0").
SETTINGS = {"builds off": None, "builds on": "0"}


def seconds(command: list[str], humming: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != HUMMING_BACKGROUND_BUILDS}
    if humming is not None:
        env[HUMMING_BACKGROUND_BUILDS] = humming
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True, env=env)
    return time.perf_counter() - start


def _command(command: list[str], script: str, checkpoint: Path) -> list[str]:
    if command[0] not in ("plan", "check"):
        return command
    words = [word.format(checkpoint=checkpoint) for word in command]
    return [script, *words]


def main() -> None:
    from tests.models.kimi_k3.kimi_k3_checkpoint import (
        KimiK3Spec,
        write_header_only_checkpoint,
    )

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    script = shutil.which("vllm-kimi-k3-moe")
    if script is None:
        sys.exit("vllm-kimi-k3-moe is not on PATH: pip install the package first")
    print(f"{'':44}{'builds off':>18}{'builds on':>18}  ({runs} runs each)")
    with tempfile.TemporaryDirectory(prefix="kimi-k3-headers-") as name:
        checkpoint = Path(name)
        write_header_only_checkpoint(checkpoint, KimiK3Spec.released())
        for label, command in COMMANDS.items():
            command = _command(command, script, checkpoint)
            times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
            for _ in range(runs):
                for setting, humming in SETTINGS.items():
                    if label == IMPORT and humming is None:
                        humming = "1"
                    times[setting].append(seconds(command, humming))
            cells = [f"median {statistics.median(t):5.1f} s" for t in times.values()]
            print(f"{label:<44}" + "".join(f"{cell:>18}" for cell in cells))


if __name__ == "__main__":
    main()
