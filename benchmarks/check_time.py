"""Wall time of ``vllm-kimi-k3-moe check`` over a header set the size of Kimi-K3's.

Writes, in a temporary directory, a release-sized checkpoint's layout without
its data (``benchmarks.header_set``: the index, the config and 96 shards of
real headers and sparse data). Then runs the
installed ``vllm-kimi-k3-moe check`` on it in fresh processes and checks it
found the checkpoint clean. Formats: ``mxfp4`` (the release, the default),
``fp8-block`` (about 2.8 TB), ``nvfp4`` (four tensors per projection).

    python -m benchmarks.check_time [RUNS] [FORMAT]    # from the repo root
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import header_set
from tests.models.kimi_k3.kimi_k3_checkpoint import KimiK3Spec


def header_bytes(directory: Path) -> int:
    """What check reads: the index, the config and each shard's header."""
    total = sum(p.stat().st_size for p in directory.glob("*.json"))
    for shard in directory.glob("*.safetensors"):
        with shard.open("rb") as file:
            total += 8 + int.from_bytes(file.read(8), "little")
    return total


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    fmt = sys.argv[2] if len(sys.argv) > 2 else "mxfp4"
    script = shutil.which("vllm-kimi-k3-moe")
    if script is None:
        sys.exit("vllm-kimi-k3-moe is not on PATH: pip install the package first")
    spec = KimiK3Spec.released()
    with tempfile.TemporaryDirectory(prefix="kimi-k3-headers-") as name:
        directory = Path(name)
        start = time.perf_counter()
        tensors = header_set.write(directory, fmt)
        written = time.perf_counter() - start
        apparent = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        print(
            f"{fmt} header set: {spec.shards} shards, {tensors} tensors, "
            f"{apparent / 1e12:.2f} TB apparent, {header_bytes(directory) / 1e6:.0f} "
            f"MB of index and headers (written in {written:.1f} s)"
        )
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            result = subprocess.run(
                [script, "check", str(directory), "--tp", "32"],
                capture_output=True,
                text=True,
            )
            times.append(time.perf_counter() - start)
            if result.returncode != 0:
                sys.exit(f"check failed ({result.returncode}):\n{result.stdout}")
        print(result.stdout.rstrip())
        print(
            f"vllm-kimi-k3-moe check --tp 32: median {statistics.median(times):.1f} s"
            f"  max {max(times):.1f} s  ({runs} runs, fresh processes)"
        )


if __name__ == "__main__":
    main()
