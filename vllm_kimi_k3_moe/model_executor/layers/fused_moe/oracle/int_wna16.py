"""Kimi-K3 routed experts on Marlin's integer kernel: w13's scales laid out
for the group the kernel reads.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.layers.fused_moe.oracle.int_wna16.
    _process_weights_marlin`` and ``_process_awq_weights_marlin`` (module
    attributes; wrappers that call them). For a Kimi-K3 routed-experts layer
    (built through the plugin: it carries ``kimi_k3_partition``) the call
    runs with that module's ``marlin_moe_permute_scales`` replaced for its
    duration by a wrapper of vLLM's own. Other layers, and the module
    outside those calls, are as upstream.
Why
    Both functions permute w13's scales with ``size_k =
    layer.intermediate_size_per_partition``, though w13's K (the GEMM's
    reduction) is the expert width. ``marlin_permute_scales`` applies the
    grouped permutation only when ``group_size < size_k``, while the
    compiled kernel (``moe_wna16_marlin_gemm``, csrc/moe/marlin_moe_wna16/
    ops.cu) takes the group to be K / scale rows and reads grouped scales
    whenever there is more than one group. Where a GPU holds as many rows
    as one group (groups of 128 at 128 rows: the plugin's whole groups at
    TP32, TP8 x DP4 and TP4 x DP8, and vLLM alone at TP16 x DP2), every w13
    scale lands in the wrong place: garbage output, silently.
How
    The permutation is called with ``size_k`` = the K its scale groups span
    (scale rows x group size): the width for w13, w2's (padded) rows for
    w2, which is what vLLM already passes for w2 in the GPTQ path.
    Per-channel scales (group -1) are permuted as before.
Related PR
    The same upstream change as the model patch: its in-tree form
    (``upstream/vllm-0.33.0.patch``, ``vllm-0.34.0.patch``) makes the same
    change in ``oracle/int_wna16.py``, where it also fixes vLLM alone's
    TP16 x DP2 (0.34.0 still permutes w13's scales for its rows).
Delete when
    With the model patch, in the vLLM release whose Marlin preparation
    permutes w13's scales for the expert width (``in_vllm`` detects it: the
    plugin then leaves this fix off).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes, unwrap_method, wrap_method
from vllm_kimi_k3_moe.verification.targets import keyword_arguments

PREPARATIONS = ("_process_weights_marlin", "_process_awq_weights_marlin")
_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.int_wna16"
PERMUTE = "marlin_moe_permute_scales"
# What the patch replaces or relies on (``vllm_kimi_k3_moe.verification``).
TARGETS = tuple(f"{_ORACLE}:{name}" for name in PREPARATIONS)
W13_SIZE_K = "layer.intermediate_size_per_partition"  # upstream's, for w13


def relied_on(find: Callable[[str], Any]) -> str | None:
    """Each preparation looks ``marlin_moe_permute_scales`` up in its module
    when it runs (what the patch replaces for the call)."""
    for target in TARGETS:
        if PERMUTE not in find(target).__code__.co_names:
            return f"{target} no longer calls {PERMUTE}"
    return None


def in_vllm(find: Callable[[str], Any]) -> str | None:
    """vLLM's own preparations permute w13's scales for the expert width."""
    firsts = [keyword_arguments(t, PERMUTE, "size_k")[:1] for t in TARGETS]
    if all(first and first[0] != W13_SIZE_K for first in firsts):
        return f"w13's scales are permuted with size_k={firsts[0][0]}"
    return None


def is_kimi_k3_routed_experts(layer: Any) -> bool:
    """Whether ``layer`` is a Kimi-K3 routed-experts layer the plugin built."""
    return getattr(layer, "kimi_k3_partition", None) is not None


def scales_for_the_gemm(own: Callable) -> Callable:
    """vLLM's ``marlin_moe_permute_scales``, told the K the kernel divides
    by the scale rows: the K the scales' groups span."""

    @functools.wraps(own)
    def permute(s: Any, size_k: int, size_n: int, group_size: int, **rest: Any) -> Any:
        # rest: what else the release passes (0.33's is_a_8bit), unchanged
        if group_size > 0:
            size_k = s.shape[1] * group_size
        return own(s=s, size_k=size_k, size_n=size_n, group_size=group_size, **rest)

    return permute


def _for_kimi_k3(upstream: ModuleType) -> Callable[[Callable], Callable]:
    def make_wrapper(own: Callable) -> Callable:
        @functools.wraps(own)
        def prepare(layer: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_kimi_k3_routed_experts(layer):
                return own(layer, *args, **kwargs)
            with replaced_attributes(
                upstream,
                marlin_moe_permute_scales=scales_for_the_gemm(
                    upstream.marlin_moe_permute_scales
                ),
            ):
                return own(layer, *args, **kwargs)

        return prepare

    return make_wrapper


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    for name in PREPARATIONS:
        wrap_method(upstream, name, _for_kimi_k3(upstream))


def revert(upstream: ModuleType) -> None:
    """Put upstream's own functions back (idempotent)."""
    for name in PREPARATIONS:
        unwrap_method(upstream, name)
