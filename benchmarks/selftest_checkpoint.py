"""Wall time and peak memory of ``vllm-kimi-k3-moe selftest --checkpoint`` on a
release-sized checkpoint.

Writes, in a temporary directory, the release's layout (96 shards, every
tensor of 92 MoE layers x 896 experts declared, ``benchmarks/check_time.py``'s
header set) as sparse files: every tensor reads as zeros. With ``filled``,
the tensors selftest reads (the first MoE layer's experts 0-31, six MXFP4
tensors each) are written with data: random FP4 values, scales of 1. Then
runs the installed ``vllm-kimi-k3-moe selftest --tp 32 --checkpoint DIR`` in
a fresh process and prints its exit status, last line, wall time and peak
resident memory (the child's ``ru_maxrss``).

    python -m benchmarks.selftest_checkpoint [zero|filled]    # from the repo root
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    expert_tensor_name,
    write_header_only_checkpoint,
)

E8M0_ONE = 127  # an MXFP4 scale byte of 2^0
LAYER, EXPERTS = 1, 32  # what selftest reads: 2 x top-16 experts of layer 1


def fill_selftest_layer(directory: Path) -> int:
    """Write data (seeded random bytes; scales of 1) into the tensors
    selftest reads, in place in the sparse shards; the bytes written."""
    import random

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    rng, written = random.Random(0), 0
    for expert in range(EXPERTS):
        for projection in ("w1", "w3", "w2"):
            for suffix in ("weight_packed", "weight_scale"):
                name = expert_tensor_name(LAYER, expert, projection, suffix)
                shard = directory / index["weight_map"][name]
                with shard.open("r+b") as file:
                    size = int.from_bytes(file.read(8), "little")
                    header = json.loads(file.read(size))
                    start, end = header[name]["data_offsets"]
                    file.seek(8 + size + start)
                    if suffix == "weight_scale":
                        data = bytes([E8M0_ONE]) * (end - start)
                    else:
                        data = rng.randbytes(end - start)
                    file.write(data)
                    written += len(data)
    return written


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "zero"
    script = shutil.which("vllm-kimi-k3-moe")
    if script is None:
        sys.exit("vllm-kimi-k3-moe is not on PATH: pip install the package first")
    with tempfile.TemporaryDirectory(prefix="kimi-k3-selftest-") as name:
        directory = Path(name)
        write_header_only_checkpoint(directory, KimiK3Spec.released())
        if mode == "filled":
            written = fill_selftest_layer(directory)
            print(f"layer {LAYER}, experts 0-{EXPERTS - 1}: {written / 1e6:.0f} MB")
        start = time.perf_counter()
        result = subprocess.run(
            [script, "selftest", "--tp", "32", "--checkpoint", str(directory)],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB
    last = (result.stdout.strip() or result.stderr.strip()).splitlines()[-1]
    print(f"exit status {result.returncode}: {last}")
    print(
        f"selftest --tp 32 --checkpoint ({mode}): {wall:.1f} s, "
        f"peak resident {peak:.1f} GiB"
    )


if __name__ == "__main__":
    main()
