"""The layouts public deployments run Kimi-K3 in, per GPU kind.

The advisor orders layouts by memory (the KV cache they leave), which puts
deep pipelines first; these are what vLLM's recipe and other public
deployments run, marked beside them so the beaten path is visible. What
each entry says comes from public sources, each entry naming its own
(vLLM's Kimi-K3 recipe, vLLM pull request #50484, NVIDIA Dynamo's recipes,
public benchmark sweeps; on AMD, ROCm/MAD's and SemiAnalysis InferenceX's
benchmark recipes);
nothing here says a layout is faster, which ``plan`` does not measure.
Plain Python: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kimi_k3_moe.tools.deployment.topology import Topology


@dataclass(frozen=True)
class PublicLayout:
    """A layout run in public on a GPU kind, and who runs it."""

    topology: Topology
    source: str
    # the flags its source runs it with, of those plan sizes by (memory
    # share, context length, KV-cache dtype); "" where none is stated
    flags: str = ""


RECIPE = "vLLM's recipe"
# kimi-k3-deployments.md, "Serving flags the recipe sets" (and its TP8 x PP2
# profile's own 0.90); NVIDIA Dynamo's H200 and GB200 recipes' shares
HOPPER = "--gpu-memory-utilization 0.97 --max-model-len 32768"
BLACKWELL = "--max-model-len 1048576 --kv-cache-dtype fp8"

# By ``--gpu`` preset. kimi-k3-deployments.md, "Layouts in vLLM's published
# recipe" and "Added later": B300/GB300 hold a replica in one node as TP8,
# with --decode-context-parallel-size 8 opt-in (measured on GB300 by vLLM
# PR #50484); H200 as TP8 x PP2 (a report moved there when one node ran
# out of memory) or TP8 x DP2; GB200/GB300 as TP4 x DP4; NVIDIA Dynamo runs
# H200 as TP8 x PP4, GB300 as TP8, GB200 as TP16; benchmark sweeps ran
# H200 as TP16 x DP2 with EP and B200 as TP8 x DP2 with EP. H100 (32 GPUs
# in the recipe) and H20 have no stated layout.
PUBLIC_LAYOUTS: dict[str, tuple[PublicLayout, ...]] = {
    "h200": (
        PublicLayout(Topology(8, pp_size=2), RECIPE, "--gpu-memory-utilization 0.90"),
        PublicLayout(Topology(8, dp_size=2), RECIPE, HOPPER),
        PublicLayout(
            Topology(8, pp_size=4),
            "NVIDIA Dynamo's recipe",
            "--gpu-memory-utilization 0.85",
        ),
        PublicLayout(
            Topology(16, dp_size=2, expert_parallel=True), "a public benchmark"
        ),
    ),
    "b200": (
        PublicLayout(
            Topology(8, dp_size=2, expert_parallel=True), "a public benchmark"
        ),
    ),
    "b300": (
        PublicLayout(Topology(8), RECIPE, BLACKWELL),
        PublicLayout(Topology(8, dcp_size=8), f"{RECIPE}, DCP opt-in", BLACKWELL),
    ),
    "gb300": (
        PublicLayout(Topology(8), f"{RECIPE}, NVIDIA Dynamo's", BLACKWELL),
        PublicLayout(Topology(8, dcp_size=8), "vLLM PR #50484", "--kv-cache-dtype fp8"),
        PublicLayout(Topology(4, dp_size=4), RECIPE, BLACKWELL),
    ),
    # vLLM's recipe lists MI355X as verified and serves AMD with AITER on
    # (VLLM_ROCM_USE_AITER=1, which plan's MI355X serve lines carry) at
    # --gpu-memory-utilization 0.95; ROCm/MAD pull request 182 and
    # SemiAnalysis's InferenceX pull request 2351 serve the MXFP4 release as
    # TP8 on one node of 8 MI355X, in the same environment.
    "mi355x": (
        PublicLayout(
            Topology(8),
            f"{RECIPE} (AITER on), ROCm/MAD PR 182, InferenceX PR 2351",
            "--gpu-memory-utilization 0.95",
        ),
    ),
    "gb200": (
        PublicLayout(Topology(4, dp_size=4), RECIPE, BLACKWELL),
        PublicLayout(
            Topology(16), "NVIDIA Dynamo's recipe", "--gpu-memory-utilization 0.92"
        ),
    ),
}


def public_layouts(gpu: str | None, gpus: int) -> tuple[PublicLayout, ...]:
    """The public layouts of exactly ``gpus`` GPUs of kind ``gpu`` (a
    ``--gpu`` preset name; none for a GPU given by its memory)."""
    if gpu is None:
        return ()
    return tuple(
        layout
        for layout in PUBLIC_LAYOUTS.get(gpu.lower(), ())
        if layout.topology.gpus == gpus
    )
