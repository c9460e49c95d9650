"""Time ``register()`` and vLLM's whole general-plugin load, in fresh processes.

python -m benchmarks.register_time [RUNS]    # from the repo root
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

ONE_RUN = """
import json, sys, time
import vllm  # loaded before plugins in every vLLM process
import vllm.plugins
from importlib.metadata import entry_points
t0 = time.perf_counter()
register = [e for e in entry_points(group="vllm.general_plugins")
            if e.name == "kimi_k3_moe"][0].load()
t1 = time.perf_counter()
register()
t2 = time.perf_counter()
vllm.plugins.load_general_plugins()
t3 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "register_ms": (t2 - t1) * 1e3,
                  "load_general_plugins_ms": (t3 - t2) * 1e3,
                  "kimi_k3_imported": any(m.startswith("vllm.models.kimi_k3")
                                          for m in sys.modules)}))
"""


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", ONE_RUN], capture_output=True, text=True, check=True
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    for key in ("import_ms", "register_ms", "load_general_plugins_ms"):
        values = [r[key] for r in results]
        print(
            f"{key:>24}: median {statistics.median(values):7.2f} ms, "
            f"max {max(values):7.2f} ms over {runs} processes"
        )
    print(f"{'kimi_k3 imported':>24}: {any(r['kimi_k3_imported'] for r in results)}")


if __name__ == "__main__":
    main()
