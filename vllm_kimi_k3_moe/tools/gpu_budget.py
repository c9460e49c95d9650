"""What one GPU offers Kimi-K3's KV cache once the weights are in.

vLLM 0.33.0 (``Worker.determine_available_memory``) takes
``ceil(total x gpu_memory_utilization)`` of each GPU (``request_memory``) and
gives the KV cache what its start-up profile leaves: minus the weights,
minus the activation peak of a dummy forward pass, minus the CUDA-graph
pool it estimates, minus memory other libraries took after its snapshot.
Only the weights can be read without a GPU; the rest is the reserve, an
estimate the operator can override (``--reserve-gib``). The CUDA context and
NCCL's buffers, allocated before vLLM's snapshot, must fit in the
``1 - gpu_memory_utilization`` vLLM leaves. Plain Python: the command line
validates these before vLLM is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
# vLLM 0.33.0's CacheConfig.gpu_memory_utilization default (a test ties them).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# Estimate, not a measurement: activation peak of vLLM's profile run
# (max_num_batched_tokens of Kimi-K3's 7168-wide hidden states, the MoE
# kernels' workspaces, the sampler's logits over 163840 tokens) plus the
# CUDA-graph pool and communication workspaces. Override with --reserve-gib
# once a real start-up log gives the number (vLLM logs the memory it
# profiled).
DEFAULT_RESERVE_GIB = 6.0


class BudgetError(ValueError):
    """A GPU budget that cannot be used; the message is one line."""


@dataclass(frozen=True)
class GpuBudget:
    """One GPU's memory as ``vllm serve`` is asked to use it."""

    gpu_memory_gib: float
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    reserve_gib: float = DEFAULT_RESERVE_GIB

    def __post_init__(self) -> None:
        if not self.gpu_memory_gib > 0:
            raise BudgetError(
                f"--gpu-memory-gib must be positive, got {self.gpu_memory_gib:g}"
            )
        if not 0 < self.utilization <= 1:
            raise BudgetError(
                "--gpu-memory-utilization must be in (0, 1], as vLLM's, got "
                f"{self.utilization:g}"
            )
        if not self.reserve_gib >= 0:
            raise BudgetError(
                f"--reserve-gib must be 0 or more, got {self.reserve_gib:g}"
            )

    @property
    def requested_bytes(self) -> int:
        """What vLLM takes of the GPU (``request_memory``)."""
        return math.ceil(self.gpu_memory_gib * GIB * self.utilization)

    @property
    def reserve_bytes(self) -> int:
        return round(self.reserve_gib * GIB)

    def kv_cache_bytes(self, weight_bytes: int) -> int:
        """Memory left for the KV cache next to ``weight_bytes`` of weights;
        negative when the weights and the reserve do not fit."""
        return self.requested_bytes - weight_bytes - self.reserve_bytes
