"""A Kimi-K3 checkpoint without its data, to try ``vllm-kimi-k3-moe check`` on.

Writes into an empty (or new) directory what ``check`` reads of a
release-sized checkpoint: ``config.json``, ``model.safetensors.index.json``
and 96 shards whose headers declare every tensor (92 MoE layers x 896
experts x the format's routed-expert tensors, and the other per-layer
tensors) and whose data sections are sparse files of their full size
(terabytes apparent, ~100-300 MB on disk). ``benchmarks.check_time`` times
``check`` on the same set. Formats: ``mxfp4`` (the release, the default),
``fp8-block``, ``nvfp4``.

    python -m benchmarks.header_set DIR [FORMAT]    # from the repo root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("mxfp4", "fp8-block", "nvfp4")


def write(directory: Path, fmt: str = "mxfp4") -> int:
    """Write the header set of ``fmt`` into ``directory``; its tensor count."""
    from tests.models.kimi_k3.format_checkpoints import write_format_checkpoint
    from tests.models.kimi_k3.kimi_k3_checkpoint import (
        KimiK3Spec,
        write_header_only_checkpoint,
    )

    spec = KimiK3Spec.released()
    if fmt == "mxfp4":
        write_header_only_checkpoint(directory, spec)
    else:
        write_format_checkpoint(directory, fmt, spec)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return len(index["weight_map"])


def fail(message: str) -> None:
    """One line on stderr, exit status 2, as the command line's errors."""
    print(f"header_set: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):
        fail(f"usage: python -m benchmarks.header_set DIR [{'|'.join(FORMATS)}]")
    directory = Path(sys.argv[1])
    fmt = sys.argv[2].lower() if len(sys.argv) == 3 else "mxfp4"
    if fmt not in FORMATS:
        sys.exit(
            f"header_set: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}"
        )
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        fail(f"{directory} exists and is not an empty directory")
    tensors = write(directory, fmt)
    shards = sorted(directory.glob("*.safetensors"))
    apparent = sum(shard.stat().st_size for shard in shards)
    on_disk = sum(p.stat().st_blocks * 512 for p in directory.iterdir())
    print(
        f"{directory}: {fmt} header set, {len(shards)} shards, {tensors} tensors, "
        f"{apparent / 1e12:.2f} TB apparent, {on_disk / 1e6:.0f} MB on disk"
    )
    print(f"try: vllm-kimi-k3-moe check {directory} --tp 32")


if __name__ == "__main__":
    main()
