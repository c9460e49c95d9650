"""How much of one GPU the installed vLLM leaves Kimi-K3's KV cache.

Of a ``GpuBudget`` (what was asked) and the ``CacheConfig`` vLLM makes for
the serving GPUs, vLLM's own functions give the share it takes
(``request_memory``, at the utilization it resolves) and how it sizes the
KV cache in it (``compat.kv_cache_sizing_after_warmup`` says which way):

- from its start-up profile (vLLM 0.33; 0.34 without its extensible KV
  cache): the KV cache gets the share less the weights and what the profile
  run measures (``gpu_budget.ACTIVATIONS_GIB``, an estimate); the CUDA
  context and NCCL's buffers take from the rest of the GPU, and
  ``request_memory`` refuses to start where they leave less free than the
  share (``gpu_budget.CONTEXT_GIB``, an estimate).
- from the memory measured after warmup (vLLM 0.34's extensible KV cache,
  on by default on CUDA, where utilization resolves to 1.0):
  ``measure_kv_cache_bytes`` gives it what is left of the GPU after the
  CUDA context, NCCL's buffers and everything resident, less a margin that
  grows with the transient peak and the peak itself, within the share.
  The reserve is what that function leaves of the share beside the KV
  cache for a GPU holding the two estimates: the context before vLLM's
  snapshot, the activation peak (its profiled activation peak and
  CUDA-graph estimate, which it keeps free) as the transient peak.

Either way the KV cache gets ``requested - weights - reserve``: vLLM's
functions subtract the weights once from whatever bounds the cache, so the
reserve does not depend on them. ``--reserve-gib`` replaces the estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe import compat
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import (
    ACTIVATIONS_GIB,
    CONTEXT_GIB,
    GIB,
    BudgetError,
    GpuBudget,
)


@dataclass(frozen=True)
class KvBudget:
    """One GPU as the installed vLLM shares it out: the share it takes
    (``requested_bytes``, at ``utilization``), and the reserve in it that
    neither the weights nor the KV cache get."""

    gpu_memory_gib: float
    utilization: float  # as vLLM resolves it
    utilization_given: bool  # --gpu-memory-utilization, else vLLM's default
    requested_bytes: int
    reserve_bytes: int
    reserve_given: bool  # --reserve-gib, else the estimate
    after_warmup: bool  # sized from memory measured after warmup

    @property
    def reserve_gib(self) -> float:
        return self.reserve_bytes / GIB

    def kv_cache_bytes(self, weight_bytes: int) -> int:
        """Memory left for the KV cache next to ``weight_bytes`` of weights;
        negative when the weights and the reserve do not fit."""
        return self.requested_bytes - weight_bytes - self.reserve_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_memory_gib": self.gpu_memory_gib,
            "utilization": self.utilization,
            "utilization_given": self.utilization_given,
            "requested_bytes": self.requested_bytes,
            "reserve_gib": self.reserve_gib,
            "reserve_given": self.reserve_given,
            "kv_cache_sized_after_warmup": self.after_warmup,
        }


def _snapshot(budget: GpuBudget) -> Any:
    """The memory snapshot vLLM's worker takes on such a GPU before it loads
    the model (``MemorySnapshot``, given its figures instead of measuring):
    the CUDA context and NCCL's buffers (the estimate) already in use."""
    from vllm.utils.mem_utils import MemorySnapshot

    total = budget.total_bytes
    return MemorySnapshot(
        device="cuda:0",
        auto_measure=False,
        total_memory=total,
        free_memory=total - round(CONTEXT_GIB * GIB),
    )


def kv_budget(budget: GpuBudget, cache_config: Any) -> KvBudget:
    """``budget`` as the installed vLLM shares the GPU out under
    ``cache_config`` (the serving GPUs', which says whether the extensible
    KV cache is on), ``--gpu-memory-utilization`` set where given; a
    ``BudgetError`` where vLLM would refuse to start on it."""
    from vllm.v1.worker.utils import request_memory

    cache_config = copy.copy(cache_config)
    if budget.utilization is not None:
        cache_config.gpu_memory_utilization = budget.utilization
    snapshot = _snapshot(budget)
    try:
        requested = request_memory(snapshot, cache_config)
    except ValueError as error:
        raise BudgetError(
            f"{compat.VLLM} would not start on GPUs of "
            f"{budget.gpu_memory_gib * GIB / 10**9:.1f} GB "
            f"({CONTEXT_GIB * GIB / 10**9:.1f} GB estimated for the CUDA context "
            f"and NCCL): {' '.join(str(error).split())}"
        ) from None
    sizing = compat.kv_cache_sizing_after_warmup(cache_config)
    if budget.reserve_gib is not None:
        reserve = round(budget.reserve_gib * GIB)
    elif sizing is None:
        reserve = round(ACTIVATIONS_GIB * GIB)
    else:
        # After warmup nothing but the estimates is in use: the context
        # (before the snapshot) and, freed again, the transient peak.
        kv = sizing.measure_kv_cache_bytes(
            init_free_memory=snapshot.free_memory,
            free_memory=snapshot.free_memory,
            committed_bytes=0,
            requested_memory=requested,
            transient_peak_bytes=round(ACTIVATIONS_GIB * GIB),
        )
        reserve = requested - kv
    return KvBudget(
        gpu_memory_gib=budget.gpu_memory_gib,
        utilization=compat.resolved_gpu_memory_utilization(cache_config),
        utilization_given=budget.utilization is not None,
        requested_bytes=requested,
        reserve_bytes=reserve,
        reserve_given=budget.reserve_gib is not None,
        after_warmup=sizing is not None,
    )
