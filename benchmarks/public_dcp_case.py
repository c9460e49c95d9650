"""What ``plan`` predicts for the published TP8 / TP8 DCP8 measurement.

vLLM pull request #50484 measured Kimi-K3 on GB300 with an FP8 KV cache:
per GPU, TP8 held 1.933 M tokens in 25.12 GiB of KV cache, TP8 DCP8 19.752 M
tokens in 34.28 GiB. Its context length, memory settings and KDA kernel are
not stated. This prints plan's tokens for the same layouts (the release in
MXFP4 on Marlin, ``--gpu gb300 --kv-cache-dtype fp8``):

- given the KV memory the measurement had (the reserve set so that exactly
  that is left), at ``--max-model-len`` 1048576 (vLLM's recipe on
  Blackwell) and 131072 (plan's default): what separates plan from the
  measurement is then how tokens are counted, each request's KDA state
  (which DCP does not split) in whole blocks against its MLA blocks;
- the same at 1048576 with FlashInfer's KDA prefill kernel (vLLM's
  ``--kda-prefill-backend flashinfer``, which GB300 runs) instead of the
  FlashKDA plan assumes, which keeps one more state block per KDA layer
  group and request (its prefill checkpoint): ``plan`` has no option for
  the KDA kernel; this module swaps the planner's stand-in;
- with plan's own memory assumptions (vLLM's default
  ``--gpu-memory-utilization`` and plan's estimate of the reserve, as the
  installed vLLM sizes the KV cache).

    python -m benchmarks.public_dcp_case    # from the repo root, ~1 min

What importing vLLM prints on a machine without a GPU is kept off the
screen, and humming's background builds off, as ``plan`` does.
"""

from __future__ import annotations

from contextlib import nullcontext

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.cli.common import no_background_kernel_builds, quiet_vllm
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GIB, GpuBudget
from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank import stand_ins
from vllm_kimi_k3_moe.tools.plan.planner import Planner

# vLLM PR #50484, "HBM KV capacity per GPU": (tokens, GiB of KV cache).
PUBLIC = {1: (1_933_000, 25.12), 8: (19_752_000, 34.28)}
GB300 = gpu_preset("gb300").memory_gib
# (what the row is, --max-model-len, the KDA prefill kernel, at the public's
# KV memory or at plan's defaults)
CASES = (
    ("plan, that KV memory, 1048576 tokens", 1048576, None, True),
    ("  the same, FlashInfer KDA prefill", 1048576, "flashinfer", True),
    ("plan, that KV memory, 131072 tokens", 131072, None, True),
    ("plan, its defaults, 1048576 tokens", 1048576, None, False),
)


def kda_prefill(backend: str | None):
    """The KDA prefill kernel the planner gives the built KDA layers."""
    if backend is None:  # what plan assumes: FlashKDA
        return nullcontext()
    return replaced_attributes(stand_ins, GPU_KDA_PREFILL_BACKEND=backend)


def sized(context: int, backend: str | None) -> dict[tuple[int, bool], object]:
    """TP8 and TP8 DCP8 on GB300s, at the public KV memory and at plan's
    defaults: the plugin's KV capacity of each."""
    found = {}
    serving = Serving(kv_cache_dtype="fp8", max_model_len=context)
    with (
        kda_prefill(backend),
        Planner(KIMI_K3_TEXT_CONFIG, serving, GpuBudget(GB300)) as planner,
    ):
        for dcp, (_, gib) in PUBLIC.items():
            deployment = Deployment(8, dcp_size=dcp)
            default = planner.plan(deployment)
            found[dcp, False] = default.fixed_kv
            # the reserve that leaves the measured KV memory next to the weights
            left = default.fixed_kv.available_bytes - round(gib * GIB)
            reserve = default.budget.reserve_gib + left / GIB
            planner.budget = GpuBudget(GB300, reserve_gib=reserve)
            found[dcp, True] = planner.plan(deployment).fixed_kv
            planner.budget = GpuBudget(GB300)
    return found


def main() -> None:
    no_background_kernel_builds()  # as plan: vLLM on the meta device only
    with quiet_vllm():
        runs = {
            (context, backend): sized(context, backend)
            for context, backend in {(c[1], c[2]) for c in CASES}
        }
    print("Kimi-K3 TP8 on GB300, FP8 KV cache, per GPU: vLLM PR #50484 and plan")
    print(f"{'':48}{'KV GiB':>8}{'tokens':>13}{'vs public':>11}")
    for dcp, (tokens, gib) in PUBLIC.items():
        name = "TP8 DCP8" if dcp > 1 else "TP8"
        print(f"{name:10}{'public (vLLM PR #50484)':38}{gib:8.2f}{tokens:13,}")
        for label, context, backend, at_public in CASES:
            kv = runs[context, backend][dcp, at_public]
            print(
                f"{'':10}{label:38}{kv.available_bytes / GIB:8.2f}"
                f"{kv.tokens:13,}{kv.tokens / tokens - 1:+11.1%}"
            )


if __name__ == "__main__":
    main()
