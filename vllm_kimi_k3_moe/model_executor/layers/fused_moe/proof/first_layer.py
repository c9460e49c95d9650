"""The proof the first Kimi-K3 layer of a process owes, where some fix went
on code it was not verified on, or with a target other code replaced at
run time (``verdict.Decision.prove``): the plugin's
registration leaves it owed (``owe``), the partition patch settles it when
vLLM builds that layer, before choosing its layout (``settle``:
``small_layer``). Proven: the decision's line is said, with what was proven.
Not: the registration's ``step_aside`` reverts every patch and says why in
one warning, and the layer is built as vLLM alone builds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import small_layer
from vllm_kimi_k3_moe.verification.verdict import Decision

logger = logging.getLogger("vllm.plugins.kimi_k3_moe")
# (the decision, what steps the plugin aside given its warning)
_owed: list[tuple[Decision, Callable[[str], None]]] = []


def owe(decision: Decision, step_aside: Callable[[str], None]) -> None:
    """The first layer built must prove the fixes (once per process)."""
    _owed[:] = [(decision, step_aside)]


def owed() -> bool:
    return bool(_owed)


def forgive() -> None:
    """Nothing owed any more (the plugin unregistered)."""
    _owed.clear()


def settle(experts: Any, moe_intermediate_size: int) -> bool:
    """Prove the fixes on small copies of ``experts`` (the first Kimi-K3
    ``RoutedExperts`` under construction): True where they hold (the line
    said), else False once the plugin stepped aside; never raises."""
    from vllm.version import __version__

    decision, step_aside = _owed.pop()
    try:
        with small_layer.quietly():
            proven = small_layer.prove(
                experts, moe_intermediate_size, decision.verified_code
            )
    except Exception as error:  # a difference must never stop vLLM
        why = str(error)
        if not isinstance(error, small_layer.NotProven):
            why = f"{type(error).__name__}: {why}"
        step_aside(
            f"vllm-kimi-k3-moe: nothing patched on vLLM {__version__}, "
            f"{decision.cause} and a small layer of this deployment built with "
            f"the fixes did not hold ({' '.join(why.split())}); vLLM runs as it "
            f"would alone. {decision.remedy}"
        )
        return False
    logger.info(f"{decision.line}; {proven}")
    return True
