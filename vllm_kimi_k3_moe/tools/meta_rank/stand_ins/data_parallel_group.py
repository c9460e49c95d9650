"""Stands in for the data-parallel group while ``selftest`` on one GPU makes
a rank's MoE kernel.

Why: with DP, vLLM makes an all-gather/reduce-scatter prepare/finalize over
the DP group, which one GPU posing as every rank in turn cannot form. What
the real group guarantees and the selftest does itself: every rank gets all
tokens and the ranks are summed, which is what the all-gather and
reduce-scatter compute for one DP rank's tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


@contextmanager
def one_gpu_for_the_data_parallel_group(moe_config: Any) -> Iterator[None]:
    """While a rank's MoE kernel is made (``process_weights_after_loading``)
    its ``FusedMoEConfig`` says data-parallel size 1: vLLM then makes the
    local prepare/finalize (``MoEPrepareAndFinalizeNoDPEP*``) instead of the
    all-gather/reduce-scatter over the DP group
    (``all2all_utils.maybe_make_prepare_finalize``), which one GPU posing as
    each rank in turn cannot form. The selftest gives every rank all tokens
    and sums the ranks, which is what the all-gather and reduce-scatter
    compute for one DP rank's tokens. The rank's TP size and rank (vLLM
    flattens them over DP), its EP size and rank and its expert map are left
    as built; the default all-to-all backend (``allgather_reducescatter``)
    makes the same experts kernel either way. Without DP, nothing changes.
    Holds no parameters."""
    parallel = moe_config.moe_parallel_config
    if parallel.dp_size == 1:
        yield
        return
    local = dataclasses.replace(parallel, dp_size=1, dp_rank=0)
    with replaced_attributes(moe_config, moe_parallel_config=local):
        yield
