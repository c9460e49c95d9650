"""Pose this CPU process as one rank of a GPU deployment.

vLLM's layers read the parallel groups (their size and this process's rank)
when they are built: ``simulated_rank`` stands in for them, so the real
model can be built on the ``meta`` device (real size, no memory) or on CPU
tensors (small shapes, real weight loading). ``rank_zero_of`` adds what
building rank 0 of a ``Deployment`` needs besides: its MoE kernel chosen as
on its GPU and bfloat16 as the default dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.gpus import named_amd_arch
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Topology
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import moe_kernel_of_the_gpu


@dataclass(frozen=True)
class Rank:
    """One GPU of a topology: its place in the TP and DP groups."""

    topology: Topology
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0


@dataclass(frozen=True)
class GroupStandIn:
    """Stands in for a ``GroupCoordinator``: without GPUs there are no
    torch.distributed groups, and building a layer (or, for the PP group, the
    whole model) reads only these: the size, this rank, and whether it is
    the first or last rank (as ``GroupCoordinator`` derives them)."""

    world_size: int
    rank_in_group: int

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


@contextmanager
def simulated_rank(rank: Rank | Topology) -> Iterator[None]:
    """Pose this process as ``rank`` (a topology: its rank 0) in the TP, DP,
    PCP, DCP, PP and EP groups (a DCP group is made of TP GPUs: this rank's
    place in it is its TP rank's within groups of DCP)."""
    from vllm.distributed import parallel_state

    if isinstance(rank, Topology):
        rank = Rank(rank)
    topology = rank.topology
    ep = topology.expert_parallel
    with replaced_attributes(
        parallel_state,
        _TP=GroupStandIn(topology.tp_size, rank.tp_rank),
        _DP=GroupStandIn(topology.dp_size, rank.dp_rank),
        _PCP=GroupStandIn(1, 0),
        _DCP=GroupStandIn(topology.dcp_size, rank.tp_rank % topology.dcp_size),
        _PP=GroupStandIn(topology.pp_size, rank.pp_rank),
        _EP=GroupStandIn(
            topology.gpus if ep else 1,
            rank.dp_rank * topology.tp_size + rank.tp_rank if ep else 0,
        ),
    ):
        yield


@contextmanager
def rank_zero_of(deployment: Deployment, pp_rank: int = 0) -> Iterator[None]:
    """Pose as rank 0 of ``deployment`` (of its pipeline stage ``pp_rank``):
    its parallel groups, its MoE kernel
    chosen as on its GPU (``stand_ins.moe_kernel_of_the_gpu``; on an AMD GPU
    named, ``gpus.an_amd_gpu_named``, ROCm's kernels answer their own device
    checks under its platform stand-in, ``stand_ins.amd_gpu``), and
    bfloat16 (Kimi-K3's dtype) as the default for unquantized weights."""
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        simulated_rank(Rank(deployment, pp_rank=pp_rank)),
        nullcontext()
        if named_amd_arch() is not None
        else moe_kernel_of_the_gpu(deployment),
        set_default_torch_dtype(torch.bfloat16),
    ):
        yield
