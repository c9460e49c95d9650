"""The online-quantization matrix: for every online path and kernel vLLM alone
builds it on (``tests/models/kimi_k3/preparation/online.PATHS``), at every
layout of ``LAYOUTS``, GPU 0 built, loaded, quantized and prepared on the
CPU as the tests do it (``online.quantize_rank``: unwritten memory reading
0x7F bytes), with vLLM alone and with the plugin: the rows each allocates
(and records it holds), and whether what it quantized is right (every held
row within the format's error of the BF16 loaded, every pad zero) or what
vLLM raised. Prints a Markdown table for the installed vLLM.

    python -m benchmarks.online_quantization    # from the repo root, ~1 min
"""

from __future__ import annotations

import importlib
import os

from tests.models.kimi_k3.preparation.online import (
    COMPOSED,
    LAYOUTS,
    PATHS,
    QuantizedRank,
    quantize_rank,
    refusal,
    what_is_wrong,
)
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank


def cell(quantized: QuantizedRank) -> str:
    """Rows allocated (rows recorded held), and right or wrong."""
    if quantized.experts is None:
        wrong = what_is_wrong(quantized) if quantized.quantized.tensors else []
        verdict = "; quantized wrong" if wrong else ""
        return f"refuses: {refusal(quantized)[:60]}{verdict}"
    config = quantized.experts.moe_config
    rows = (
        f"{config.intermediate_size_per_partition} "
        f"({config.intermediate_size_per_partition_unpadded})"
    )
    return f"{rows} {'wrong' if what_is_wrong(quantized) else 'right'}"


def main() -> None:
    import torch
    from vllm.version import __version__

    import vllm_kimi_k3_moe

    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    torch.set_num_threads(1)
    vllm_kimi_k3_moe.register()
    kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    print(f"vLLM {__version__}: rows per GPU (rows recorded held), GPU 0")
    print()
    print("| path | kernel | layout | vLLM alone | with the plugin |")
    print("|---|---|---|---|---|")
    for path in PATHS + COMPOSED:
        for backend in path.backends:
            for topology, _ in LAYOUTS:
                rank = Rank(topology)
                theirs = quantize_rank(kimi_model, path, backend, rank, alone=True)
                mine = quantize_rank(kimi_model, path, backend, rank)
                print(
                    f"| {path.label()} | {backend} | {topology.label()} | "
                    f"{cell(theirs)} | {cell(mine)} |"
                )


if __name__ == "__main__":
    main()
