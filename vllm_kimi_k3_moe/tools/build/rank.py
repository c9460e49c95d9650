"""Build real vLLM Kimi-K3 MoE layers as one rank of a deployment, without GPUs.

vLLM's layers read only two things from the machine at construction: the
parallel groups (for their size and this process's rank) and, to pick an MoE
kernel, whether the current device supports it. This module stands in for the
groups (``simulated_rank``) and, for MXFP4, makes vLLM pick the kernel the
caller names (``mxfp4_backend_chosen``), so the real ``KimiMoE`` can be built
on the ``meta`` device (real size, no memory) or on CPU tensors (small shapes,
real weight loading). Used by the planner and by the regression suite, which
keeps its own stand-ins for the other kernels' device checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.tools.topology import MXFP4_PATHS


@dataclass(frozen=True)
class Topology:
    """One rank of a TP (x DP) deployment, with or without expert parallelism."""

    tp_size: int
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False


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
def replaced_attributes(target: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``target`` for the block, then put back exactly what
    it held itself (a class's staticmethod stays one; an inherited attribute
    is inherited again)."""
    absent = object()
    saved = {name: vars(target).get(name, absent) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is absent:
                delattr(target, name)
            else:
                setattr(target, name, value)


@contextmanager
def simulated_rank(topology: Topology) -> Iterator[None]:
    """Pose this process as ``topology``'s rank (TP, DP, PCP, PP, EP groups)."""
    from vllm.distributed import parallel_state

    ep = topology.expert_parallel
    with replaced_attributes(
        parallel_state,
        _TP=GroupStandIn(topology.tp_size, topology.tp_rank),
        _DP=GroupStandIn(topology.dp_size, topology.dp_rank),
        _PCP=GroupStandIn(1, 0),
        _PP=GroupStandIn(1, 0),
        _EP=GroupStandIn(
            topology.tp_size * topology.dp_size if ep else 1,
            topology.dp_rank * topology.tp_size + topology.tp_rank if ep else 0,
        ),
    ):
        yield


# compressed-tensors' description of MXFP4 weights: FP4 in groups of 32
MXFP4_WEIGHT_ARGS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "group",
    "group_size": 32,
    "symmetric": True,
    "dynamic": False,
}

# A compressed-tensors MXFP4 block that vLLM does not rewrite to native MXFP4
# (only format "mxfp4-pack-quantized" is). It targets the routed experts only:
# vLLM has no MXFP4 linear kernel on a CPU, and the MoE method is chosen from
# the weight arguments alone.
COMPRESSED_TENSORS_MXFP4_EXPERTS = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "routed_experts": {
            "targets": [r"re:.*\.experts\.\d+\..+"],
            "weights": MXFP4_WEIGHT_ARGS,
            "input_activations": None,
            "format": "pack-quantized",
        }
    },
    "ignore": [],
}


def quant_config(quantization: str) -> Any:
    """The vLLM quantization config of one of the ``MXFP4_PATHS``, for the
    routed experts alone (the MoE-layer planner and the tests)."""
    if quantization == "mxfp4":
        from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

        return Mxfp4Config()
    if quantization == "compressed-tensors":
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
            CompressedTensorsConfig,
        )

        return CompressedTensorsConfig.from_config(COMPRESSED_TENSORS_MXFP4_EXPERTS)
    raise ValueError(
        f"unknown quantization path {quantization!r}; "
        f"choose one of {', '.join(MXFP4_PATHS)}"
    )


@contextmanager
def mxfp4_backend_chosen(quantization: str, backend: str) -> Iterator[None]:
    """Make vLLM's MXFP4 MoE method run ``backend`` (an ``Mxfp4MoeBackend`` name,
    any case), as the platform check would on a GPU that runs it: the native
    method's selector, or the compressed-tensors method's CUTLASS device check,
    answers for the GPU this machine may not have."""
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import (
        CutlassExpertsMxfp4,
    )
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        backend_to_kernel_cls,
    )
    from vllm.model_executor.layers.quantization import mxfp4

    chosen = Mxfp4MoeBackend[backend.upper()]
    if quantization == "compressed-tensors":
        cutlass = chosen == Mxfp4MoeBackend.CUTLASS_MXFP4_MXFP4
        with replaced_attributes(
            CutlassExpertsMxfp4, _supports_current_device=staticmethod(lambda: cutlass)
        ):
            yield
        return
    experts_cls = backend_to_kernel_cls(chosen)[0]
    with replaced_attributes(
        mxfp4,
        select_deepseek_v4_mxfp4_moe_backend=lambda moe: (chosen, experts_cls),
    ):
        yield


def moe_backend_setting(deployment: Any) -> str:
    """The ``--moe-backend`` a ``deployment.Deployment`` is built with. On the
    MXFP4 paths ``marlin``, whatever kernel it names: ``mxfp4_backend_chosen``
    makes vLLM pick that one (their names are ``Mxfp4MoeBackend``'s). The
    other formats take vLLM's own ``--moe-backend`` names."""
    return "marlin" if deployment.quantization in MXFP4_PATHS else deployment.backend


@contextmanager
def rank_zero_of(deployment: Any) -> Iterator[Topology]:
    """Pose as rank 0 of a ``deployment.Deployment``: its parallel groups,
    its MoE kernel chosen (an MXFP4 one named by ``mxfp4_backend_chosen``;
    another format's by vLLM's own selection, every kernel's device check
    answering as on its GPU), and bfloat16 (Kimi-K3's dtype) as the default
    for unquantized weights. Yields the topology."""
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_kimi_k3_moe.tools.build.stand_ins import moe_kernels_on_their_gpu

    topology = Topology(
        deployment.tp_size,
        dp_size=deployment.dp_size,
        expert_parallel=deployment.expert_parallel,
    )
    kernel = (
        mxfp4_backend_chosen(deployment.quantization, deployment.backend)
        if deployment.quantization in MXFP4_PATHS
        else moe_kernels_on_their_gpu()
    )
    with simulated_rank(topology), kernel, set_default_torch_dtype(torch.bfloat16):
        yield topology


def rank_vllm_config(
    topology: Topology,
    quantization: str = "mxfp4",
    model_config: Any = None,
) -> Any:
    """A fresh ``VllmConfig`` for ``topology`` (vLLM refuses two layers with
    one name under one config): MXFP4 of ``quantization``'s path, or, given a
    checkpoint's ``ModelConfig``, what vLLM resolves from it. Its MoE
    backend is ``marlin`` (as ``--moe-backend marlin`` sets it) whatever
    kernel the caller means to run: the planner makes vLLM pick its MXFP4
    kernel with ``mxfp4_backend_chosen``; the tests keep Marlin and answer
    its device check, which a CPU box fails."""
    from vllm.config import DeviceConfig, KernelConfig, ParallelConfig, VllmConfig

    if model_config is not None:
        return VllmConfig(
            model_config=model_config,
            quant_config=None,  # vLLM resolves the checkpoint's own
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(
                tensor_parallel_size=topology.tp_size,
                data_parallel_size=topology.dp_size,
                enable_expert_parallel=topology.expert_parallel,
            ),
            kernel_config=KernelConfig(moe_backend="marlin"),
        )
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        quant_config=quant_config(quantization),
    )
    vllm_config.kernel_config.moe_backend = "marlin"
    parallel = vllm_config.parallel_config
    parallel.tensor_parallel_size = topology.tp_size
    parallel.data_parallel_size = topology.dp_size
    parallel.enable_expert_parallel = topology.expert_parallel
    return vllm_config


def build_kimi_moe_layer(
    kimi_moe_cls: type,
    config: Any,
    vllm_config: Any,
    device: str = "meta",
    prefix: str = "model.layers.1.block_sparse_moe",
) -> Any:
    """Construct ``kimi_moe_cls`` the way ``KimiDecoderLayer`` does, under
    ``vllm_config`` and on ``device`` (``meta``: real shapes, no memory)."""
    import torch
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), torch.device(device):
        return kimi_moe_cls(
            config, vllm_config, quant_config=vllm_config.quant_config, prefix=prefix
        )
