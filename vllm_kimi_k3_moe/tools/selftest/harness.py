"""Run every rank of a layout through vLLM and sum them, as the all-reduce does.

For each rank (each TP rank of each DP rank: without expert parallelism
vLLM shards every expert over all of them): pose as that rank
(``meta_rank.rank.simulated_rank``), make its ``VllmConfig``, build its
``KimiMoE`` through the plugin, load the layer's expert tensors through
vLLM's loader, set the router's correction bias as a checkpoint does, and
run the same inputs through the rank's experts (``kernels``: the GPU's
selected kernel, or the CPU reference). The ranks' outputs are summed as
the all-reduce sums them, to be compared with the unsharded experts
(``reference``), computed here from the same tensors. ``vllm_alone`` takes
the plugin out of the process for a block, as ``selftest`` does for vLLM
alone's partition. ``run`` makes a selftest of these; the forward tests
call them directly.
"""

from __future__ import annotations

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
from vllm_kimi_k3_moe.tools.check.layout import MODELOPT_CONFIG_FILE
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank, simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    OnlineQuantization,
    rank_vllm_config,
)
from vllm_kimi_k3_moe.tools.selftest.checkpoint import (
    ExpertCheckpoint,
    open_checkpoint,
    read_experts,
    zero_data_refusal,
)
from vllm_kimi_k3_moe.tools.selftest.dequantize import one_expert
from vllm_kimi_k3_moe.tools.selftest.kernels import Forward, KernelPath, RankKernel
from vllm_kimi_k3_moe.tools.selftest.layer import (
    build_moe_layers,
    kimi_moe,
    load_experts,
    routed_experts,
    vision_language_model,
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

if TYPE_CHECKING:
    from torch import Tensor, nn


class SelftestUnusable(ValueError):
    """What cannot be judged here: the kernel does not run the format on
    this machine at all (not even unsharded), or the checkpoint's expert
    data cannot tell a right layout from a wrong one; one line."""


@dataclass(frozen=True)
class SelftestCase:
    """One selftest: a format (its ``quantization_config``: the published
    one unless given), a layout, a kernel, Kimi-K3's MoE fields (or a
    ``config.json``'s), and the flags of a method quantizing while vLLM loads
    (``online``; the format is then the checkpoint's, BF16)."""

    quantization: str  # a ``formats`` name
    topology: Topology
    backend: str = "marlin"
    text_config: dict[str, Any] = field(default_factory=lambda: KIMI_K3_MOE_FIELDS)
    quantization_config: dict[str, Any] | None = None  # None: the published
    online: OnlineQuantization | None = None  # quantized while loading

    def config(self) -> dict[str, Any] | None:
        if self.quantization_config is not None:
            return self.quantization_config
        return format_named(self.quantization).published_quantization_config()

    def checkpoint_format(self) -> CheckpointFormat:
        return recognise(self.config(), None, f"the {self.quantization} config")

    def deployment(self, topology: Topology) -> Deployment:
        return Deployment.of(topology, self.backend, self.quantization)


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
    forward: Forward  # to be run inside ``kernel.context()``
    kernel: RankKernel


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
    make the inputs and compute the reference on ``path``'s device;
    ``SelftestUnusable`` if the checkpoint's expert bytes are all zero."""
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
    if checkpoint is not None and not any(t.any() for t in tensors.values()):
        # a header-only or sparse copy reads as zeros: every format's values
        # or scales are zero, and so is every layout's output
        raise SelftestUnusable(zero_data_refusal(checkpoint))
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
            layer.model_dir,
            topology,
            case.backend,
            device=path.device.type,
            online=case.online,
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
                load_experts(model, layer.tensors, vision_language_model(kimi_model))
            moe = kimi_moe(model)
            moe.gate.e_score_correction_bias.data.copy_(layer.inputs.bias)
            kernel = path.prepare(model, case.quantization, vllm_config)
            yield LoadedRank(routed_experts(moe), kernel.forward, kernel)


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
    1, 16 and 128 tokens (the path's ``batch_sizes``, where it has its
    own), summed as the all-reduce sums them: tokens -> output.
    ``on_rank(rank, loaded)`` is called with each loaded rank."""
    import torch

    sums: dict[int, Tensor] = {}
    for rank in ranks_of(topology or case.topology):
        with loaded_rank(path, case, kimi_model, layer, rank, building) as loaded:
            for tokens in getattr(path, "batch_sizes", BATCH_SIZES):
                with loaded.kernel.context():
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
