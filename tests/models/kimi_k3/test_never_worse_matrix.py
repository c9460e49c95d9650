"""Never worse than vLLM alone, over the quantization configs vLLM accepts for
Kimi-K3's experts (``quantization_space``, not only the presets), every TP
size Kimi-K3 builds, DP 1/2/4/8 without expert parallelism, expert
parallelism, and every kernel a config takes (by its ``--moe-backend``):
wherever vLLM alone builds the layer, the plugin builds it on the same method
and kernel, at a partition its kernel keeps as it is (no second pad when it
prepares its weights) and no larger than what vLLM alone's kernel keeps
(unless that kernel refuses vLLM alone's partition after the build:
``AFTER_BUILD``); where vLLM alone fails,
the plugin either builds it or fails with vLLM alone's own error. One real
``KimiMoE`` per case, rank 0, on the meta device: 27 configs, 90 (config,
kernel) pairs, 26 topologies, 2340 cases."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import pytest

from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.formats import format_of_method
from vllm_kimi_k3_moe.model_executor.layers.fused_moe import kernel_rows
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import kernel_of
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank

TP_SIZES = (1, 2, 4, 8, 16, 32)  # whole heads (96) and vocabulary rows
DP_SIZES = (1, 2, 4, 8)
TOPOLOGIES = [Topology(tp, dp_size=dp) for tp in TP_SIZES for dp in DP_SIZES] + [
    # whole experts (896 over 8 or 128 GPUs): vLLM pads nothing there
    Topology(tp, dp_size=dp, expert_parallel=True)
    for tp, dp in ((8, 1), (32, 4))
]


def _moe_backends() -> list[str]:
    """Every ``--moe-backend`` vLLM 0.33.0 takes, but ``auto`` (vLLM resolves
    it from the GPU it starts on)."""
    from vllm.config.kernel import MoEBackend

    return [name for name in typing.get_args(MoEBackend) if name != "auto"]


# Formats whose kernel's limit vLLM alone does not check when it builds the
# layer: the compressed-tensors MXFP4 method allocates what it is given (the
# MXFP4 sizing oracle is its kernels' limit:
# test_compressed_tensors_mxfp4_padding), NVFP4 on CUTLASS refuses a pad at
# weight preparation (test_nvfp4_cutlass_weight_prep_refuses_a_pad).
AFTER_BUILD = {"ct-mxfp4", "nvfp4", "modelopt-nvfp4"}


@dataclass(frozen=True)
class Built:
    partition: int
    kernel: tuple[str, ...]  # method, experts class, backend
    kernel_takes_it: bool = True  # its format's rule accepts the partition
    format: str | None = None
    # the rows its kernel keeps once its weight preparation padded them (the
    # format's ``resident``, held to that preparation by the tests in
    # ``preparation/``)
    resident: int = 0
    choice: Any = None  # the plugin's PartitionChoice (None: vLLM alone's)
    intermediate: int = 0  # the layer's moe_intermediate_size


@dataclass(frozen=True)
class Refused:
    error: str


# Every rank 0 built in this session, by (config, backend, topology, options):
# the preparation tests pick their layouts from the same builds.
_OUTCOMES: dict[tuple[Any, ...], Built | Refused] = {}


def outcome(format_experts, config: str, backend: str, topology: Topology, **kw):
    """Rank 0 of ``topology`` serving ``config`` on ``backend`` (with the
    plugin unless ``upstream=True``), built once a session on the meta
    device: what it allocates and on which kernel, or vLLM's refusal."""
    key = (config, backend, topology, tuple(sorted(kw.items())))
    if key not in _OUTCOMES:
        _OUTCOMES[key] = _outcome(format_experts, config, backend, topology, **kw)
    return _OUTCOMES[key]


def _outcome(format_experts, config: str, backend: str, topology: Topology, **kw):
    try:
        experts = format_experts(config, backend, topology, **kw)
    except Exception as error:
        return Refused(f"{type(error).__name__}: {error}")
    method, partition = experts.quant_method, experts.intermediate_size_per_partition
    names = tuple(getattr(part, "__name__", str(part)) for part in kernel_of(method))
    fmt = format_of_method(method)
    with simulated_rank(topology):  # a learned rule runs create_weights
        rule = kernel_rows.rule_of(method, experts.moe_config)
    hidden = experts.moe_config.hidden_dim
    takes = not rule or not rule.accepts or rule.accepts(method, hidden, partition)
    resident = kernel_rows.resident(rule, method, partition) if rule else partition
    choice = getattr(experts, "kimi_k3_partition", None)
    intermediate = experts.moe_config.intermediate_size
    return Built(
        partition, names, takes, fmt and fmt.name, resident, choice, intermediate
    )


def label(topology: Topology) -> str:
    return f"{topology.label()} (MoE over {topology.moe_group} GPUs)"


def kernels_taken(format_experts, config: str) -> list[str]:
    """One ``--moe-backend`` per kernel vLLM alone builds the config on,
    unsplit (compressed-tensors MXFP4 picks its kernel from the GPU whatever
    the flag says: one of the twenty that name it stands for all)."""
    by_kernel: dict[tuple[str, ...], str] = {}
    for backend in _moe_backends():
        built = outcome(format_experts, config, backend, Topology(1), upstream=True)
        if isinstance(built, Built):
            by_kernel.setdefault(built.kernel, backend)
    return list(by_kernel.values())


@pytest.mark.parametrize("config", sorted(QUANTIZATION_CONFIGS))
def test_never_worse_than_vllm_alone(format_experts, config):
    """Every kernel the config takes at every topology."""
    taken = kernels_taken(format_experts, config)
    assert taken, f"{config}: vLLM alone builds it on no --moe-backend"
    for backend in taken:
        for topology in TOPOLOGIES:
            theirs = outcome(format_experts, config, backend, topology, upstream=True)
            mine = outcome(format_experts, config, backend, topology)
            where = f"{config} on {backend} at {label(topology)}"
            if isinstance(theirs, Refused):
                assert isinstance(mine, Built) or mine == theirs, where
                continue
            assert isinstance(mine, Built), f"{where}: vLLM alone builds, {mine}"
            assert mine.kernel == theirs.kernel, where
            # no second pad at weight preparation, but where the plugin keeps
            # vLLM alone's partition (no other builds on its kernel)
            kept = (mine.partition, mine.kernel) == (theirs.partition, theirs.kernel)
            assert mine.resident == mine.partition or kept, f"{where}: padded again"
            if theirs.kernel_takes_it:
                assert mine.partition <= theirs.resident, (
                    f"{where}: {mine.partition} > vLLM alone's {theirs.resident}"
                )
            else:
                assert theirs.format in AFTER_BUILD, where
