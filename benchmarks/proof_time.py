"""Time the small-layer proof
(``vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof.small_layer``):
what the first Kimi-K3 layer a process builds adds, on vLLM code the plugin
was not verified on, before any layer gets the fixes. The layer is built as
vLLM builds it at Kimi-K3's real size (latent width 3584, 3072 intermediate)
on ``meta``; the proof then builds, loads and checks its small copies (two
experts, real widths, one per GPU of the split) on the CPU, the slow case: a
serving process runs the same code on its GPU. Unverified code, here: the
installed vLLM with its recorded digests changed (as the tests do).

    python -m benchmarks.proof_time [FORMAT:BACKEND:TP ...]   # from the repo root
"""

from __future__ import annotations

import argparse
import importlib
import logging
import time

DEFAULT = (
    "mxfp4:marlin:32",
    "fp8-block:triton:32",
    "nvfp4:cutlass:32",
    "awq:marlin:32",
    "mxfp4:marlin:16",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=DEFAULT)
    args = parser.parse_args()

    import torch
    from vllm.version import __version__

    import vllm_kimi_k3_moe
    from upstream import partition_matrix as matrix
    from upstream import project_helpers as helpers
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import (
        first_layer,
        small_layer,
    )
    from vllm_kimi_k3_moe.verification import verdict

    torch.set_num_threads(1)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    verdict.VERIFIED_CODE = {
        release: {patch: {**code, "digest": "other"} for patch, code in fixes.items()}
        for release, fixes in verdict.VERIFIED_CODE.items()
    }
    vllm_kimi_k3_moe.register()
    model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    patches = [p for _, p in vllm_kimi_k3_moe.PATCHES]
    decision = verdict.decide(  # the one registration made: checked code
        verdict.judge_all(patches),
        __version__,
        plain=False,
        prover=vllm_kimi_k3_moe.PARTITION_PATCH,
    )
    own, took = small_layer.prove, []

    def timed(*arguments: object) -> str:
        start = time.perf_counter()
        try:
            return own(*arguments)
        finally:
            took.append(time.perf_counter() - start)

    small_layer.prove = timed
    print(f"vLLM {__version__}, one CPU thread: the proof at the first layer")
    print("| format | backend | GPUs | proof | result |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        fmt, backend, tp = case.split(":")
        first_layer.owe(decision, vllm_kimi_k3_moe._step_aside)  # each a first
        vllm_kimi_k3_moe._decided[:] = [tuple(p for _, p in vllm_kimi_k3_moe.PATCHES)]
        took.clear()
        with helpers.moe_kernels_on_their_gpu():
            matrix.build_experts(
                model, fmt, backend, helpers.Topology(int(tp)), small=False
            )
        result = "holds" if vllm_kimi_k3_moe._decided[0] else "stepped aside"
        print(f"| {fmt} | {backend} | {tp} | {took[0] * 1e3:.0f} ms | {result} |")
        if not vllm_kimi_k3_moe._decided[0]:
            break  # nothing is patched any more


if __name__ == "__main__":
    main()
