"""What ``plan`` says, beside its table, of a BF16 checkpoint quantized while
vLLM loads it (``--quantization fp8_per_block``, ...): where the method's
partition could not be learned (vLLM alone's is then sized), and how each
layer is counted."""

from __future__ import annotations

from collections.abc import Callable

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import (
    ONLINE_NOT_LEARNED,
)
from vllm_kimi_k3_moe.tools.plan.values import DeploymentPlan


def note_online(
    online: str | None, plans: list[DeploymentPlan], say: Callable[[str], None]
) -> None:
    """One line where ``online``'s partition was not learned for a layout
    ``plans`` sized, and one saying how each layer is counted."""
    if online is None:
        return
    kept = [
        plan.moe.deployment.label()
        for plan in plans
        if plan.moe.fixed.partition_reason == ONLINE_NOT_LEARNED
    ]
    if kept:
        say(
            f"plan: note: --quantization {online}: its partition cannot be "
            f"learned from what it quantizes to ({', '.join(kept)}): vLLM "
            "alone's partition, as the plugin keeps it, and its routed experts "
            "counted as the BF16 it loads"
        )
    routed = (
        ""
        if len(kept) == len(plans)
        else "routed experts counted as the quantized tensors the method hands "
        "its kernel; "
    )
    say(
        f"plan: note: --quantization {online}: {routed}each linear layer it "
        "quantizes as what it quantizes it to, every other layer as vLLM "
        "allocates it; --model names the BF16 checkpoint"
    )
