"""Build real vLLM Kimi-K3 MoE layers as one rank of a deployment, without GPUs.

vLLM's layers read only two things from the machine at construction: the
parallel groups (for their size and this process's rank) and, to pick an MoE
kernel, whether the current device supports it. This module stands in for
exactly those, so the real ``KimiMoE`` can be built on the ``meta`` device (real
size, no memory) or on CPU tensors (small shapes, real weight loading). Used by
the regression suite's fixtures and by the planner.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.deployment import QUANTIZATION_PATHS


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
    torch.distributed groups, and building a layer reads only these two."""

    world_size: int
    rank_in_group: int


@contextmanager
def _attributes(target: Any, **values: Any) -> Iterator[None]:
    saved = {name: getattr(target, name) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


@contextmanager
def simulated_rank(topology: Topology) -> Iterator[None]:
    """Pose this process as ``topology``'s rank (TP, DP, PCP, PP, EP groups)."""
    from vllm.distributed import parallel_state

    ep = topology.expert_parallel
    with _attributes(
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


@contextmanager
def marlin_without_gpu() -> Iterator[None]:
    """Let vLLM select the Marlin MoE kernel on a machine without CUDA, as
    ``--moe-backend marlin`` does on the GPUs it runs on (its device check is
    the only part that needs one)."""
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe

    with _attributes(
        marlin_moe.MarlinExpertsBase,
        _supports_current_device=staticmethod(lambda: True),
    ):
        yield


@functools.cache
def _import_moe_kernel_modules() -> None:
    """Import every module vLLM's MoE kernels live in: fused_moe/experts/ and
    a few fused_moe/*.py, which vLLM's backend oracles import lazily."""
    import importlib
    import pkgutil

    from vllm.model_executor.layers import fused_moe
    from vllm.model_executor.layers.fused_moe import experts

    for package in (fused_moe, experts):
        for module in pkgutil.iter_modules(package.__path__):
            try:
                importlib.import_module(f"{package.__name__}.{module.name}")
            except Exception:
                continue  # it fails the same way when an oracle imports it


def _moe_kernel_classes() -> set[type]:
    """Every fused-MoE kernel class vLLM ships."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    _import_moe_kernel_modules()
    found: set[type] = set()
    todo = [FusedMoEExperts]
    while todo:
        for subclass in todo.pop().__subclasses__():
            if subclass not in found:
                found.add(subclass)
                todo.append(subclass)
    return found


class _CudaPlatform:
    """vLLM's current platform, answering as the NVIDIA GPU it would run on
    where the unquantized MoE oracle lists its backends by platform."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_device_capability_family(self, *args: Any, **kwargs: Any) -> bool:
        return False


@contextmanager
def moe_kernels_on_their_gpu() -> Iterator[None]:
    """Let vLLM's own backend selection pick any MoE kernel (``--moe-backend
    NAME``) as it would on a GPU that runs it: every kernel's device check
    (``_supports_current_device``) answers yes, the platform reports FP8
    support (Triton's FP8 schemes depend on it), and the unquantized oracle
    lists the CUDA backends. What each kernel accepts of the layer (its
    activation, quantization scheme, shapes) is still vLLM's own answer."""
    from contextlib import ExitStack

    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    from vllm.platforms import current_platform

    with ExitStack() as stack:
        for kernel in _moe_kernel_classes():
            if "_supports_current_device" in kernel.__dict__:
                stack.enter_context(
                    _attributes(
                        kernel, _supports_current_device=staticmethod(lambda: True)
                    )
                )
        stack.enter_context(_attributes(current_platform, supports_fp8=lambda: True))
        stack.enter_context(
            _attributes(unquantized, current_platform=_CudaPlatform(current_platform))
        )
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
    """The vLLM quantization config of one of ``QUANTIZATION_PATHS``."""
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
        f"choose one of {', '.join(QUANTIZATION_PATHS)}"
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
        with _attributes(
            CutlassExpertsMxfp4, _supports_current_device=staticmethod(lambda: cutlass)
        ):
            yield
        return
    experts_cls = backend_to_kernel_cls(chosen)[0]
    with _attributes(
        mxfp4,
        select_deepseek_v4_mxfp4_moe_backend=lambda moe: (chosen, experts_cls),
    ):
        yield


def rank_vllm_config(
    topology: Topology, quantization: str = "mxfp4", model_config: Any = None
) -> Any:
    """A fresh ``VllmConfig`` on Marlin for ``topology`` (vLLM refuses two
    layers with one name under one config): MXFP4 of ``quantization``'s path,
    or, given a checkpoint's ``ModelConfig``, what vLLM resolves from it."""
    from vllm.config import DeviceConfig, KernelConfig, ParallelConfig, VllmConfig

    if model_config is not None:
        return VllmConfig(
            model_config=model_config,
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
