"""Run every rank of a layout through vLLM, sum them, compare.

For each rank (each TP rank of each DP rank: without expert parallelism
vLLM shards every expert over all of them): pose as that rank
(``build.rank.simulated_rank``), make its ``VllmConfig``, build its
``KimiMoE`` through the plugin, load the layer's expert tensors through
vLLM's loader, set the router's correction bias as a checkpoint does, and
run the same inputs through the rank's experts (``kernels``: the GPU's
selected kernel, or the CPU reference). The ranks' outputs are summed as
the all-reduce sums them and compared with the unsharded experts
(``reference``). The same kernel at one rank holding every row (TP1, no
pads) is run first: its error is the kernel's own (its activation
quantization, BF16 rounding), and the layout's must stay within twice it
(or the path's floor). A layout with a wrong partition, pad or scale is off
by far more (the README's vLLM-alone table: 0.3 to 7, or NaN).

Then rank 0 is built again with the plugin taken out of the process
(``vllm_alone``: ``vllm_kimi_k3_moe.unregister``, and ``register`` after),
for vLLM alone's partition and, on a GPU, its time next to the plugin's.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.formats import CheckpointFormat, format_named, recognise
from vllm_kimi_k3_moe.patching import replaced_attributes, upstream_class
from vllm_kimi_k3_moe.tools.build.rank import Rank, simulated_rank
from vllm_kimi_k3_moe.tools.build.vllm_config import rank_vllm_config
from vllm_kimi_k3_moe.tools.check.layout import MODELOPT_CONFIG_FILE
from vllm_kimi_k3_moe.tools.selftest.checkpoint import (
    ExpertCheckpoint,
    open_checkpoint,
    read_experts,
)
from vllm_kimi_k3_moe.tools.selftest.dequantize import one_expert
from vllm_kimi_k3_moe.tools.selftest.kernels import Forward, KernelPath
from vllm_kimi_k3_moe.tools.selftest.layer import (
    build_moe_layers,
    kimi_moe,
    load_experts,
    routed_experts,
    write_layer_config,
)
from vllm_kimi_k3_moe.tools.selftest.reference import (
    BATCH_SIZES,
    MoeInputs,
    moe_inputs,
    reference_output,
    relative_error,
)
from vllm_kimi_k3_moe.tools.selftest.shape import MoeShape, moe_shape
from vllm_kimi_k3_moe.tools.selftest.synthetic import write_synthetic_checkpoint
from vllm_kimi_k3_moe.tools.selftest.timing import median_microseconds
from vllm_kimi_k3_moe.tools.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.topology import Deployment, Topology

if TYPE_CHECKING:
    from torch import Tensor, nn

# The layout's error may be this many times the unsharded kernel's: each
# rank rounds its partial sum, and the ranks' roundings add up.
SHARDING_ALLOWANCE = 2.0


class SelftestUnusable(ValueError):
    """The kernel cannot run this format on this machine at all (not even
    unsharded); one line."""


@dataclass(frozen=True)
class SelftestCase:
    """One selftest: a format (its ``quantization_config``: the published
    one unless given), a layout, a kernel, Kimi-K3's MoE fields (or a
    ``config.json``'s)."""

    quantization: str  # a ``formats`` name
    topology: Topology
    backend: str = "marlin"
    text_config: dict[str, Any] = field(default_factory=lambda: KIMI_K3_MOE_FIELDS)
    quantization_config: dict[str, Any] | None = None  # None: the published

    def config(self) -> dict[str, Any] | None:
        if self.quantization_config is not None:
            return self.quantization_config
        return format_named(self.quantization).published_quantization_config()

    def checkpoint_format(self) -> CheckpointFormat:
        return recognise(self.config(), None, f"the {self.quantization} config")

    def deployment(self, topology: Topology) -> Deployment:
        return Deployment.of(topology, self.backend, self.quantization)


@dataclass(frozen=True)
class RankPartition:
    """What one rank allocated, read from its built layer."""

    rank: Rank
    allocated: int  # intermediate rows per expert
    local_experts: int


@dataclass
class SelftestResult:
    """Everything ``report`` prints."""

    case: SelftestCase
    shape: MoeShape
    device: str  # "cpu" or the GPU's name
    timed: bool  # a GPU kernel's times
    checkpoint: Path | None  # the real checkpoint read, or None (synthetic)
    kernel: str = ""
    partitions: list[RankPartition] = field(default_factory=list)
    rows_loaded: list[tuple[int, int]] = field(default_factory=list)  # per rank
    errors: dict[int, float] = field(default_factory=dict)  # tokens -> error
    unsharded: dict[int, float] = field(default_factory=dict)
    tolerances: dict[int, float] = field(default_factory=dict)
    floor: float = 0.0  # the least of them: the path's arithmetic
    failure: str | None = None  # how the plugin's layout failed to run
    vllm_alone: int | None = None  # vLLM alone's rank-0 partition
    vllm_alone_failure: str | None = None
    # tokens -> (plugin's, vLLM alone's) median microseconds of rank 0
    times: dict[int, tuple[float, float | None]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failure is None and all(
            math.isfinite(error) and error <= self.tolerances[tokens]
            for tokens, error in self.errors.items()
        )


@contextmanager
def vllm_alone(kimi_model: ModuleType) -> Iterator[None]:
    """vLLM 0.33.0 alone in this process: the plugin unregistered (every
    patch reverted) for the block, registered again after. Where the plugin
    is not applied (a patched vLLM, ``VLLM_PLUGINS`` without it), as it is."""
    applied = kimi_model.KimiMoE is not upstream_class(kimi_model.KimiMoE)
    if applied:
        vllm_kimi_k3_moe.unregister()
    try:
        yield
    finally:
        if applied:
            vllm_kimi_k3_moe.register()


@dataclass
class LoadedRank:
    experts: nn.Module  # the rank's RoutedExperts
    forward: Forward


@dataclass
class PreparedLayer:
    """What every rank is built and filled from."""

    shape: MoeShape
    format: CheckpointFormat  # the experts' checkpoint format
    model_dir: Path  # the config.json every rank is built from
    tensors: dict[str, Tensor]  # the layer's expert tensors, by checkpoint key
    inputs: MoeInputs
    expected: Tensor  # the unsharded experts' output, float64, every token


def prepare_layer(
    case: SelftestCase,
    path: KernelPath,
    workdir: Path,
    checkpoint: ExpertCheckpoint | None = None,
) -> PreparedLayer:
    """Write the layer's ``config.json`` to ``workdir``, read its experts
    (from ``checkpoint``, or a synthetic checkpoint written to ``workdir``),
    make the inputs and compute the reference on ``path``'s device."""
    shape = moe_shape(
        case.text_config,
        case.topology,
        reduced_width=not path.timed and checkpoint is None,
    )
    if checkpoint is None:
        fmt = case.checkpoint_format()
        write_layer_config(workdir, case.text_config, shape, case.config())
        write_synthetic_checkpoint(workdir, fmt, shape)
        source = open_checkpoint(workdir)
    else:
        fmt, source = checkpoint.layout.format, checkpoint
        write_layer_config(
            workdir, case.text_config, shape, checkpoint.quantization_config
        )
        if checkpoint.hf_quant_config is not None:
            shutil.copy(checkpoint.directory / MODELOPT_CONFIG_FILE, workdir)
    tensors = read_experts(source, fmt, shape)
    weights = one_expert(case.quantization, tensors, path.device)
    inputs = moe_inputs(weights(0)[0], shape, path.device)
    expected = reference_output(weights, inputs, shape)
    return PreparedLayer(shape, fmt, workdir, tensors, inputs, expected)


@contextmanager
def loaded_rank(
    path: KernelPath,
    case: SelftestCase,
    kimi_model: ModuleType,
    layer: PreparedLayer,
    rank: Rank,
    building: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> Iterator[LoadedRank]:
    """``rank``'s layer, built by the ``KimiMoE`` vLLM's model module holds
    now (the plugin's, or vLLM alone's inside ``vllm_alone``), loaded, its
    router's bias set, ready to run on ``path``; as the rank for the block.
    ``building()`` is entered while it is built and loaded (the tests make
    uninitialised memory visible with it)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker import workspace

    topology = rank.topology
    with simulated_rank(rank), path.selection(case.deployment(topology)):
        vllm_config = rank_vllm_config(
            layer.model_dir, topology, case.backend, device=path.device.type
        )
        with (
            set_current_vllm_config(vllm_config),
            # what a GPU worker makes at start-up (init_workspace_manager):
            # the kernels' scratch buffers, here one manager per rank
            replaced_attributes(
                workspace, _manager=workspace.WorkspaceManager(path.device)
            ),
        ):
            with building():
                model = build_moe_layers(
                    kimi_model, kimi_model.KimiMoE, vllm_config, str(path.device)
                )
                load_experts(model, layer.tensors)
            moe = kimi_moe(model)
            moe.gate.e_score_correction_bias.data.copy_(layer.inputs.bias)
            forward = path.prepare(model, case.quantization, vllm_config)
            yield LoadedRank(routed_experts(moe), forward)


def ranks_of(topology: Topology) -> list[Rank]:
    """Every GPU of one pipeline stage, in vLLM's flattened MoE order (rank
    ``dp * TP + tp``): without expert parallelism each holds a slice of
    every expert, with it whole experts."""
    return [
        Rank(topology, tp_rank=tp, dp_rank=dp)
        for dp in range(topology.dp_size)
        for tp in range(topology.tp_size)
    ]


def deployment_outputs(
    path: KernelPath,
    case: SelftestCase,
    kimi_model: ModuleType,
    layer: PreparedLayer,
    topology: Topology | None = None,
    building: Callable[[], AbstractContextManager[Any]] = nullcontext,
    on_rank: Callable[[Rank, LoadedRank], None] | None = None,
) -> dict[int, Tensor]:
    """Every rank of ``topology`` (default: the case's) run on the first
    1, 16 and 128 tokens, summed as the all-reduce sums them: tokens ->
    output. ``on_rank(rank, loaded)`` is called with each loaded rank."""
    import torch

    sums: dict[int, Tensor] = {}
    for rank in ranks_of(topology or case.topology):
        with loaded_rank(path, case, kimi_model, layer, rank, building) as loaded:
            for tokens in BATCH_SIZES:
                output = loaded.forward(*layer.inputs.first(tokens)).float()
                sums[tokens] = output + sums[tokens] if tokens in sums else output
            if on_rank is not None:
                on_rank(rank, loaded)
        del loaded
        if path.device.type == "cuda":
            torch.cuda.empty_cache()
    return sums


def errors_of(outputs: dict[int, Tensor], layer: PreparedLayer) -> dict[int, float]:
    """tokens -> relative error of the summed output against the reference."""
    return {
        tokens: relative_error(output, layer.expected[:tokens])
        for tokens, output in outputs.items()
    }


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _times(loaded: LoadedRank, layer: PreparedLayer) -> dict[int, float]:
    return {
        tokens: median_microseconds(loaded.forward, *layer.inputs.first(tokens))
        for tokens in BATCH_SIZES
    }


def _compare_with_vllm_alone(
    path: KernelPath,
    case: SelftestCase,
    kimi_model: ModuleType,
    layer: PreparedLayer,
    result: SelftestResult,
) -> None:
    """vLLM alone's rank 0: its partition and, on a GPU, its time."""
    try:
        with (
            vllm_alone(kimi_model),
            loaded_rank(
                path, case, kimi_model, layer, ranks_of(case.topology)[0]
            ) as loaded,
        ):
            result.vllm_alone = loaded.experts.intermediate_size_per_partition
            if path.timed:
                alone = _times(loaded, layer)
                result.times = {
                    tokens: (plugin, alone[tokens])
                    for tokens, (plugin, _) in result.times.items()
                }
    except Exception as error:  # what vLLM alone cannot build or run
        result.vllm_alone_failure = _one_line(error)


def run_selftest(
    case: SelftestCase,
    path: KernelPath,
    kimi_model: ModuleType,
    workdir: Path,
    checkpoint: ExpertCheckpoint | None = None,
    device_name: str = "cpu",
) -> SelftestResult:
    """Run ``case`` on ``path`` with the layer's experts from ``checkpoint``
    (None: a synthetic checkpoint in the format), working in ``workdir``.
    ``SelftestUnusable`` if the kernel does not run the format unsharded."""
    layer = prepare_layer(case, path, workdir, checkpoint)
    result = SelftestResult(
        case,
        layer.shape,
        device_name,
        path.timed,
        checkpoint.directory if checkpoint else None,
    )
    try:
        unsharded = deployment_outputs(path, case, kimi_model, layer, Topology(1))
    except Exception as error:
        raise SelftestUnusable(
            f"vLLM does not run {case.quantization} on --moe-backend "
            f"{case.backend} here ({device_name}), not even unsharded: "
            f"{_one_line(error)}"
        ) from error
    result.unsharded = errors_of(unsharded, layer)
    if not all(math.isfinite(error) for error in result.unsharded.values()):
        result.failure = (
            "the unsharded layer (one rank, every row) is not finite on this "
            "kernel: the layout cannot be judged"
        )
        return result
    result.floor = path.floor
    result.tolerances = {
        tokens: max(path.floor, SHARDING_ALLOWANCE * error)
        for tokens, error in result.unsharded.items()
    }
    if not case.topology.expert_parallel:
        result.rows_loaded = layer.format.rank_rows(
            layer.shape.intermediate, case.topology.moe_group
        )

    def record(rank: Rank, loaded: LoadedRank) -> None:
        experts = loaded.experts
        result.kernel = result.kernel or path.kernel(experts)
        result.partitions.append(
            RankPartition(
                rank, experts.intermediate_size_per_partition, experts.local_num_experts
            )
        )
        if path.timed and len(result.partitions) == 1:
            result.times = {n: (t, None) for n, t in _times(loaded, layer).items()}

    try:
        outputs = deployment_outputs(path, case, kimi_model, layer, on_rank=record)
        result.errors = errors_of(outputs, layer)
    except Exception as error:  # a rank the plugin's layout cannot build or run
        result.failure = f"rank {len(result.partitions)}: {_one_line(error)}"
    _compare_with_vllm_alone(path, case, kimi_model, layer, result)
    return result
