"""One rank's routed experts as a GPU kernel receives them: built and loaded
as the selftest builds and loads them (vLLM's ``KimiMoE`` through the
plugin, a synthetic checkpoint through vLLM's loader), then prepared by the
selected kernel's own ``process_weights_after_loading`` on the CPU, only its
compiled ops and device calls stood in (``stand_ins``).

``representatives`` picks, for a config and kernel, one rank of each
distinct layout the never-worse matrix builds: the partition, how many
checkpoint rows that GPU holds (whole groups leave the last GPUs none), and
expert parallelism. The kernel families' tests hold what ``prepare_rank``
returns to what the compiled kernel assumes.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from tests.models.kimi_k3.preparation import stand_ins
from vllm_kimi_k3_moe.formats import (
    CheckpointFormat,
    FormatError,
    format_named,
    recognise,
)
from vllm_kimi_k3_moe.formats.fp8_block import FP8_BLOCK
from vllm_kimi_k3_moe.formats.layouts import (
    FLOAT_SCALES,
    SCALE,
    ExpertScalar,
    ExpertTensorLayout,
    ExpertTensors,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import (
    PartitionChoice,
)
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    one_gpu_for_the_data_parallel_group,
)
from vllm_kimi_k3_moe.tools.selftest.harness import (
    PreparedLayer,
    SelftestCase,
    loaded_rank,
    vllm_alone,
)
from vllm_kimi_k3_moe.tools.selftest.kernels import RankKernel, ReferenceKernel
from vllm_kimi_k3_moe.tools.selftest.layer import (
    kimi_moe,
    routed_experts,
    write_layer_config,
)
from vllm_kimi_k3_moe.tools.selftest.shape import moe_shape
from vllm_kimi_k3_moe.tools.selftest.synthetic import expert_tensors

# Top-2 of 4 experts (2 x top-k, as the selftest builds): the preparation
# loops over experts alike, and the rows of each are the real ones.
FEW_EXPERTS = {**KIMI_K3_MOE_FIELDS, "num_experts_per_token": 2}


def format_name(config: str) -> str | None:
    """The registry format of a config in ``QUANTIZATION_CONFIGS``, if any
    (native MXFP4 and FP8 configs are vLLM's own, not a checkpoint's)."""
    try:
        return recognise(QUANTIZATION_CONFIGS[config], None, config).format.name
    except FormatError:
        return None


def configs_of(*formats: str) -> list[str]:
    """Every config the never-worse matrix builds in one of ``formats``."""
    return sorted(c for c in QUANTIZATION_CONFIGS if format_name(c) in formats)


# The configs no registry format recognises, and the checkpoint each is
# loaded from. Native MXFP4 is what vLLM rewrites the release's
# mxfp4-pack-quantized to: the release's checkpoint (and config), loaded by
# the same method. Compressed-tensors FP8 per output channel or per tensor:
# FP8 weights as FP8 block's, one scale per row ([rows, 1]) or per tensor
# ([1]), as compressed-tensors stores them; the config is their own.
_FP8 = ExpertTensorLayout("weight", dtypes=("F8_E4M3",))
_WHOLE_ROW = 1 << 30  # more input columns than any projection has: one scale
UNRECOGNISED: dict[str, tuple[str, CheckpointFormat | None]] = {
    "mxfp4": ("mxfp4", None),
    "ct-fp8-channel": (
        FP8_BLOCK.name,
        CheckpointFormat(
            FP8_BLOCK,
            "compressed-tensors FP8 per channel",
            ExpertTensors(
                "FP8 channel",
                (_FP8, ExpertTensorLayout(SCALE, _WHOLE_ROW, dtypes=FLOAT_SCALES)),
            ),
        ),
    ),
    "ct-fp8-tensor": (
        FP8_BLOCK.name,
        CheckpointFormat(
            FP8_BLOCK,
            "compressed-tensors FP8 per tensor",
            ExpertTensors(
                "FP8 tensor", (_FP8,), (ExpertScalar(SCALE, (1,), FLOAT_SCALES),)
            ),
        ),
    ),
}


def checkpoint_format(config: str) -> CheckpointFormat:
    """The checkpoint format ``config``'s synthetic layer is written in."""
    if config not in UNRECOGNISED:
        return recognise(QUANTIZATION_CONFIGS[config], None, config)
    fmt, checkpoint = UNRECOGNISED[config]
    if checkpoint is not None:
        return checkpoint
    return recognise(format_named(fmt).published_quantization_config(), None, fmt)


@dataclass(frozen=True)
class PreparationCase:
    """One GPU of a layout serving a config on a kernel."""

    config: str  # a name in kimi_k3_formats.QUANTIZATION_CONFIGS
    backend: str  # --moe-backend
    topology: Topology
    rank: int = 0  # flattened over DP: dp_rank * TP + tp_rank
    rows: int = 0  # checkpoint rows of every expert this GPU holds
    allocated: int = 0  # the rows the plugin allocates there (representatives)
    method: str = ""  # the vLLM MoE method built there (its class name)

    def label(self) -> str:
        return (
            f"{self.config} on {self.backend} at {self.topology.label()} "
            f"GPU {self.rank} ({self.rows} rows held)"
        )

    def gpu(self) -> Rank:
        """The GPU ``rank`` names: TP rank ``rank % TP`` of DP rank
        ``rank // TP``."""
        tp = self.topology.tp_size
        return Rank(self.topology, tp_rank=self.rank % tp, dp_rank=self.rank // tp)

    def selftest_case(self) -> SelftestCase:
        config = QUANTIZATION_CONFIGS[self.config]
        if self.config in UNRECOGNISED:
            fmt, checkpoint = UNRECOGNISED[self.config]
            if checkpoint is None:  # the format's published config
                config = None
        else:
            fmt = recognise(config, None, self.config).format.name
        return SelftestCase(fmt, self.topology, self.backend, FEW_EXPERTS, config)


@dataclass
class PreparedRank:
    """A rank's experts after the kernel prepared them."""

    case: PreparationCase
    experts: Any  # vLLM's RoutedExperts, prepared
    loaded: dict[str, Any]  # every parameter as loaded, before preparation
    choice: PartitionChoice  # what the plugin chose for it
    width: int  # the experts' input width (w13's K)


class PreparedOnCpu:
    """A ``KernelPath`` whose ``prepare`` runs the selected kernel's weight
    preparation on the CPU (and keeps what it was given); nothing is run."""

    timed = False
    floor = 0.0

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.reference = ReferenceKernel()
        self.loaded: dict[str, Any] = {}

    def selection(self, deployment: Any) -> Any:
        return self.reference.selection(deployment)

    def prepare(self, model: Any, fmt: str, vllm_config: Any) -> RankKernel:
        from vllm.model_executor.model_loader.base_loader import _has_online_quant
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_processing,
        )
        from vllm.model_executor.model_loader.utils import (
            process_weights_after_loading,
        )

        experts = routed_experts(kimi_moe(model))
        self.loaded = {
            name: param.detach().clone() for name, param in experts.named_parameters()
        }
        with (
            stand_ins.on_cpu(),
            one_gpu_for_the_data_parallel_group(experts.quant_method.moe),
        ):
            # as BaseModelLoader.load_model: a layer quantized while loading
            # whose pads were never loaded (its loader's count stops short of
            # the allocation) is materialised and quantized here
            if _has_online_quant(experts):
                finalize_layerwise_processing(experts, vllm_config.model_config)
            process_weights_after_loading(
                experts, vllm_config.model_config, self.device
            )
        return RankKernel(_not_run, contextlib.nullcontext)

    def kernel(self, experts: Any) -> str:
        return self.reference.kernel(experts)


def _not_run(hidden: Any, logits: Any) -> Any:
    raise AssertionError("a prepared rank is checked, not run: no GPU kernel here")


_WORKDIR = tempfile.TemporaryDirectory(prefix="kimi-k3-preparation-")


@functools.cache
def _layer(config: str, topology: Topology) -> PreparedLayer:
    """The synthetic layer every rank of ``config`` loads (one per config;
    expert parallelism spreads as many experts as GPUs): the selftest's
    tensors and ``config.json``, no inputs or reference (nothing is run)."""
    import torch

    case = PreparationCase(config, "marlin", topology).selftest_case()
    workdir = Path(_WORKDIR.name) / f"{config}-{topology.label().replace(' ', '-')}"
    workdir.mkdir()
    shape = moe_shape(case.text_config, topology, reduced_width=True)
    fmt = checkpoint_format(config)
    write_layer_config(workdir, case.text_config, shape, case.config())
    tensors = expert_tensors(fmt, shape)
    unrouted = SimpleNamespace(bias=torch.zeros(shape.experts))
    return PreparedLayer(shape, fmt, workdir, tensors, unrouted, torch.empty(0))


def _layer_topology(topology: Topology) -> Topology:
    """Ranks share a synthetic layer unless expert parallelism changes the
    experts built (``shape.reduced_experts``)."""
    return topology if topology.expert_parallel else Topology(1)


def prepare_rank(kimi_model: ModuleType, case: PreparationCase) -> PreparedRank:
    """``case``'s GPU built, loaded and prepared by its kernel."""
    selftest = case.selftest_case()
    layer = _layer(case.config, _layer_topology(case.topology))
    path = PreparedOnCpu()
    rank = case.gpu()
    with loaded_rank(
        path, selftest, kimi_model, layer, rank, building=stand_ins.loading
    ) as loaded:
        experts = loaded.experts
        return PreparedRank(
            case, experts, path.loaded, experts.kimi_k3_partition, layer.shape.width
        )


def prepare_vllm_alone_rank(kimi_model: ModuleType, case: PreparationCase) -> Any:
    """``case``'s GPU as vLLM alone builds, loads and prepares it (the plugin
    taken out of the process): its routed experts."""
    layer = _layer(case.config, _layer_topology(case.topology))
    rank = case.gpu()
    with (
        vllm_alone(kimi_model),
        loaded_rank(
            PreparedOnCpu(),
            case.selftest_case(),
            kimi_model,
            layer,
            rank,
            building=stand_ins.loading,
        ) as loaded,
    ):
        return loaded.experts


def rows_held(
    choice: PartitionChoice, intermediate: int, topology: Topology
) -> list[int]:
    """Checkpoint rows of every expert (its own, with expert parallelism)
    each GPU sharing the layer holds."""
    gpus = topology.moe_group
    if topology.expert_parallel:
        return [intermediate] * gpus
    if not choice.whole_groups:  # the even slice (vLLM alone's model-level
        # padding, where the plugin keeps it, adds zero rows, not checkpoint's)
        return [choice.logical] * gpus
    n = choice.allocated
    return [
        max(0, min(intermediate, (r + 1) * n) - min(intermediate, r * n))
        for r in range(gpus)
    ]


def representatives(
    format_experts: Any, config: str, backend: str
) -> list[PreparationCase]:
    """One GPU of each distinct layout the plugin gives ``config`` on
    ``backend`` over the never-worse matrix's topologies (rank 0's choice,
    built on the meta device, as the matrix builds it: once a session);
    where vLLM refuses a topology, none."""
    # a test module, imported here only: what runs outside pytest (the
    # benchmarks) builds from this file without pytest installed
    from tests.models.kimi_k3.test_never_worse_matrix import TOPOLOGIES, Built, outcome

    found: dict[tuple[Any, ...], PreparationCase] = {}
    for topology in TOPOLOGIES:
        built = outcome(format_experts, config, backend, topology)
        if not isinstance(built, Built):  # vLLM refuses it: nothing to prepare
            continue
        choice, method = built.choice, built.kernel[0]
        held = rows_held(choice, built.intermediate, topology)
        for rank, rows in enumerate(held):
            key = (
                choice.allocated,
                rows,
                choice.whole_groups,
                topology.expert_parallel,
            )
            if (*key, method) not in found:
                found[(*key, method)] = PreparationCase(
                    config, backend, topology, rank, rows, choice.allocated, method
                )
    return list(found.values())


def layouts_on(format_experts: Any, config: str, backend: str) -> list[PreparationCase]:
    """``representatives``: at least one, or the plugin builds nothing there."""
    cases = representatives(format_experts, config, backend)
    assert cases, f"{config}: the plugin builds no layout on {backend}"
    return cases


def assert_prepared_right(
    kimi_model: ModuleType,
    cases: list[PreparationCase],
    problems_of: Callable[[PreparedRank], list[str]],
    kernel: type | None = None,
) -> None:
    """Each case built, loaded and prepared by its kernel (``kernel``: the
    experts class vLLM must have selected), held to ``problems_of``; every
    problem of every case reported at once."""
    found = []
    for case in cases:
        prepared = prepare_rank(kimi_model, case)
        if kernel is not None:
            assert prepared.experts.quant_method.experts_cls is kernel, case.label()
        found += problems_of(prepared)
    assert not found, "\n".join(found)


def with_rank(case: PreparationCase, rank: int) -> PreparationCase:
    return replace(case, rank=rank)
