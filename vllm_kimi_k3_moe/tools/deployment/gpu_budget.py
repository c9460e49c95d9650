"""What one GPU is asked to give vLLM, as the operator says it.

vLLM takes a share of each GPU (``--gpu-memory-utilization``: its
``request_memory``, ``ceil(total x utilization)``); of that share the
weights and the KV cache get most, and the rest, the reserve, is what vLLM
measures at start-up beside them. ``plan`` counts the weights exactly; the
reserve is an estimate (``--reserve-gib`` replaces it with the figure a
start-up log gives: GPU GiB x utilization - weights - KV cache). Which
utilization the installed vLLM takes by default, and what its reserve
holds, is ``kv_budget``'s (after vLLM is imported); here is what was asked,
validated before vLLM is imported, and the estimates the reserve is made
of. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
# Estimate, not a measurement: the activation peak of vLLM's start-up run
# (max_num_batched_tokens of Kimi-K3's 7168-wide hidden states, the MoE
# kernels' workspaces, the sampler's logits over 163840 tokens) plus the
# CUDA-graph pool and communication workspaces: what vLLM's start-up
# profile (or, sizing after warmup, its measured transient peak) keeps
# beside the weights. vLLM logs what it measured.
ACTIVATIONS_GIB = 6.0
# Estimate, not a measurement: what each GPU holds before vLLM's memory
# snapshot (the CUDA context, NCCL's communicator buffers, cuBLAS handles).
# Profile sizing leaves it outside vLLM's share; sizing after warmup takes
# it out of the KV cache.
CONTEXT_GIB = 2.0


class BudgetError(ValueError):
    """A GPU budget that cannot be used; the message is one line."""


@dataclass(frozen=True)
class GpuBudget:
    """One GPU's memory as ``vllm serve`` is asked to use it: its size in
    GiB, ``--gpu-memory-utilization`` (``None``: not given, vLLM's own
    default, and the serve lines leave it unset) and ``--reserve-gib``
    (``None``: plan's estimate for the installed vLLM)."""

    gpu_memory_gib: float
    utilization: float | None = None
    reserve_gib: float | None = None

    def __post_init__(self) -> None:
        if not self.gpu_memory_gib > 0:
            raise BudgetError(
                f"--gpu-memory-gib must be positive, got {self.gpu_memory_gib:g}"
            )
        if self.utilization is not None and not 0 < self.utilization <= 1:
            raise BudgetError(
                "--gpu-memory-utilization must be in (0, 1], as vLLM's, got "
                f"{self.utilization:g}"
            )
        if self.reserve_gib is not None and not self.reserve_gib >= 0:
            raise BudgetError(
                f"--reserve-gib must be 0 or more, got {self.reserve_gib:g}"
            )

    @property
    def total_bytes(self) -> int:
        """The GPU's memory, as CUDA reports it to a process."""
        return round(self.gpu_memory_gib * GIB)
