"""Time what verifying the fixes adds to each vLLM process: the plugin judges
every patch (``vllm_kimi_k3_moe.verification``) when vLLM imports its Kimi-K3
model, before it applies any. Fresh processes, vLLM's model already imported
(what the judging itself costs: the modules its targets name that are not
imported yet, reading their source, the checks).

python -m benchmarks.verify_time [RUNS] [--vllm DIR]   # from the repo root

``--vllm DIR`` puts a vLLM copy first on the path (e.g. one made by
``tests.drift.copies``), where the digests differ and every check runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE_RUN = """
import importlib, json, time
importlib.import_module("vllm.models.kimi_k3.nvidia.model")
t0 = time.perf_counter()
from vllm.version import __version__
import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.verification import verdict
verdicts = verdict.judge_all([p for _, p in vllm_kimi_k3_moe.PATCHES])
decision = verdict.decide(verdicts, __version__, plain=False)
t1 = time.perf_counter()
print(json.dumps({"verify_ms": (t1 - t0) * 1e3, "version": __version__,
                  "states": sorted({v.state for v in verdicts})}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="?", type=int, default=3)
    parser.add_argument("--vllm", help="a directory holding a vllm package")
    args = parser.parse_args()
    env = dict(os.environ, VLLM_PLUGINS="")  # the benchmark judges, not vLLM
    if args.vllm:
        env["PYTHONPATH"] = os.pathsep.join([args.vllm, os.getcwd()])
    results = []
    for _ in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", ONE_RUN],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    values = [r["verify_ms"] for r in results]
    print(
        f"vLLM {results[0]['version']} ({', '.join(results[0]['states'])}): "
        f"verification median {statistics.median(values):.1f} ms, "
        f"max {max(values):.1f} ms over {args.runs} processes"
    )


if __name__ == "__main__":
    main()
