"""Wall time of a ``plan`` question asked again, against importing vLLM.

In fresh processes, with a new, empty answer cache (``tools.deployment.remembered``):
the question once (the full build: vLLM imported, its model built), then
RUNS pairs, alternating so each pair sees the same load, of importing
vLLM's Kimi-K3 model (what every build pays first) and the same question
asked again; every answer asked again must print the first's bytes. Prints
each median and the ratio asked again / import.

    python -m benchmarks.asked_again [RUNS] [PLAN ARGUMENTS ...]
    # default: 5 runs of plan --gpus 32 --gpu h20; from the repo root
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_kimi_k3_moe.tools.cli.common import HUMMING_BACKGROUND_BUILDS
from vllm_kimi_k3_moe.tools.deployment.remembered import CACHE_VARIABLE

IMPORT = "import vllm.models.kimi_k3.nvidia.model"
DEFAULT_QUESTION = ["plan", "--gpus", "32", "--gpu", "h20"]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, bytes]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, check=True, env=env)
    return time.perf_counter() - start, done.stdout


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    question = sys.argv[2:] or DEFAULT_QUESTION
    plan = [sys.executable, "-m", "vllm_kimi_k3_moe", *question]
    with tempfile.TemporaryDirectory(prefix="kimi-k3-answers-") as kept:
        # the tools turn humming's background builds off; the import alike
        env = {**os.environ, CACHE_VARIABLE: kept, HUMMING_BACKGROUND_BUILDS: "1"}
        first, printed = timed(plan, env)
        imports, again = [], []
        for _ in range(runs):
            imports.append(timed([sys.executable, "-c", IMPORT], env)[0])
            seconds, printed_again = timed(plan, env)
            if printed_again != printed:
                sys.exit("asked again, plan printed something else")
            again.append(seconds)
    vllm, kept_answer = statistics.median(imports), statistics.median(again)
    print(f"vllm-kimi-k3-moe {' '.join(question)}  ({runs} pairs)")
    print(f"  first (full build)                        {first:7.2f} s")
    print(f"  {IMPORT:<42}{vllm:7.2f} s median")
    print(f"  asked again (same bytes)                  {kept_answer:7.2f} s median")
    print(f"  asked again / import                      {kept_answer / vllm:7.3f}")


if __name__ == "__main__":
    main()
