"""Wall time of one ``vllm-kimi-k3-moe`` command from two source trees, in
paired runs: each pair runs it from BEFORE then from AFTER (the package
imported from that tree), so both see the same load. Prints each median
and the ratio after / before; the exit status of the command does not
matter (a refused argument is timed too).

    python -m benchmarks.before_after BEFORE AFTER RUNS ARGUMENTS ...
    # e.g. OLD_CHECKOUT . 5 plan --gpus 8 --gpu h200 --max-model-len 131072x
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


def seconds(tree: str, arguments: list[str], kept: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), CACHE_VARIABLE: kept}
    env.pop(HUMMING_BACKGROUND_BUILDS, None)  # as the tools run
    command = [sys.executable, "-m", "vllm_kimi_k3_moe", *arguments]
    start = time.perf_counter()
    # run from the tree: ``-m`` puts the working directory first on sys.path
    subprocess.run(command, capture_output=True, check=False, env=env, cwd=tree)
    return time.perf_counter() - start


def main() -> None:
    before, after, runs, *arguments = sys.argv[1:]
    times: dict[str, list[float]] = {before: [], after: []}
    # one answer cache for the run: AFTER keeps answers, BEFORE does not read it
    with tempfile.TemporaryDirectory(prefix="kimi-k3-answers-") as kept:
        for _ in range(int(runs)):
            for tree in times:
                times[tree].append(seconds(tree, arguments, kept))
    medians = {tree: statistics.median(t) for tree, t in times.items()}
    print(f"vllm-kimi-k3-moe {' '.join(arguments)}  ({runs} pairs)")
    for label, tree in (("before", before), ("after", after)):
        print(f"  {label:<7}{tree:<24}{medians[tree]:7.2f} s median")
    print(f"  after / before                 {medians[after] / medians[before]:7.3f}")


if __name__ == "__main__":
    main()
