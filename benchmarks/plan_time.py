"""Wall time of ``vllm-kimi-k3-moe plan`` in fresh processes, vLLM import included.

Times one configuration (``plan --tp 32``), the default TP8/16/32 table
(``plan``), the advisor over every layout of 32 H200s (``plan --gpus 32
--gpu h200``), and, for reference, the bare import of vLLM's Kimi-K3 model
that all of them pay.

    python -m benchmarks.plan_time [RUNS]    # from the repo root
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import vllm.models.kimi_k3.nvidia.model": [
        sys.executable,
        "-c",
        "import vllm.models.kimi_k3.nvidia.model",
    ],
    "vllm-kimi-k3-moe plan --tp 32": ["plan", "--tp", "32"],
    "vllm-kimi-k3-moe plan": ["plan"],
    "vllm-kimi-k3-moe plan --gpus 32 --gpu h200": [
        "plan",
        "--gpus",
        "32",
        "--gpu",
        "h200",
    ],
}


def seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    script = shutil.which("vllm-kimi-k3-moe")
    if script is None:
        sys.exit("vllm-kimi-k3-moe is not on PATH: pip install the package first")
    for label, command in COMMANDS.items():
        if command[0] == "plan":
            command = [script, *command]
        times = [seconds(command) for _ in range(runs)]
        print(
            f"{label:<42} median {statistics.median(times):6.1f} s  "
            f"max {max(times):6.1f} s  ({runs} runs)"
        )


if __name__ == "__main__":
    main()
