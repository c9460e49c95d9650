"""One GPU of a BF16 Kimi-K3 checkpoint served with online quantization: built
(the plugin's ``KimiMoE``, or vLLM alone's), loaded by vLLM's loader, quantized
by the method's own ``process_weights_after_loading`` and prepared by its
kernel on the CPU, as ``harness`` prepares a quantized checkpoint's.

``PATHS`` lists every online method and each kernel vLLM alone builds it on
for Kimi-K3 (the ``--moe-backend`` naming it, on the GPU that runs it).
``quantize_rank`` returns what the method produced before its kernel
prepared it (``Quantized``: vLLM's tensors as the method hands them to its
``_setup_kernel``, read, not changed), the layer prepared, and the BF16 rows
the GPU loaded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from tests.models.kimi_k3.builders import HUGE_BYTE
from tests.models.kimi_k3.gpu_stand_ins import a_cuda_node, uninitialised_memory_reads
from tests.models.kimi_k3.preparation import stand_ins
from tests.models.kimi_k3.preparation.harness import FEW_EXPERTS, PreparedOnCpu
from tests.models.kimi_k3.preparation.online_formats import quantization_problems
from vllm_kimi_k3_moe.compat import (
    lut_b_online_quantization_exists,
    moe_padding_fill_params,
)
from vllm_kimi_k3_moe.formats import recognise
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import kernel_of
from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import HOPPER
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import OnlineQuantization
from vllm_kimi_k3_moe.tools.selftest.harness import (
    PreparedLayer,
    SelftestCase,
    loaded_rank,
    vllm_alone,
)
from vllm_kimi_k3_moe.tools.selftest.layer import write_layer_config
from vllm_kimi_k3_moe.tools.selftest.shape import moe_shape
from vllm_kimi_k3_moe.tools.selftest.synthetic import expert_tensors

BLACKWELL = (10, 0)  # nvfp4_per_token's minimum; FlashInfer TRT-LLM, b12x


@dataclass(frozen=True)
class OnlinePath:
    """An online method as ``vllm serve`` is asked for it, and the kernels
    vLLM alone builds it on for Kimi-K3 (``--moe-backend`` names, on the GPU
    of ``capability``)."""

    name: str  # the ``--quantization`` shorthand
    method: str  # the vLLM class it builds for the routed experts
    format: str  # how its quantized tensors dequantize (``dequantize``)
    backends: tuple[str, ...]
    capability: tuple[int, int] = HOPPER
    # the checkpoint's own quantization_config, which leaves the experts
    # unquantized (None: a BF16 checkpoint)
    checkpoint: str | None = None

    def online(self) -> OnlineQuantization:
        """``--quantization-config '{"moe": name}'``: the routed experts get
        the method ``--quantization name`` gives them
        (``test_each_flag_gives_the_experts_the_method_tested``); the latent
        projections keep the checkpoint's (their online kernels are not
        stood in). Over a quantized checkpoint, composed with its method."""
        moe = json.dumps({"moe": self.name})
        return OnlineQuantization(None if self.checkpoint else "online", moe)

    def label(self) -> str:
        return self.name + (" over a quantized checkpoint" if self.checkpoint else "")


# Every online path of the issue, with the kernels vLLM 0.33.0 and 0.34.0
# alone build each on for Kimi-K3's SiTU at TP1 (``test_the_kernels_are_
# vllm_alones`` holds this to vLLM's selection; the ROCm-only AITER, which
# ``auto`` picks on a CPU box that answers every device check, is left out).
PATHS = (
    OnlinePath(
        "fp8_per_block",
        "Fp8PerBlockOnlineMoEMethod",
        "fp8-block",
        ("triton", "marlin", "humming"),
    ),
    OnlinePath(
        "mxfp4",
        "Mxfp4OnlineMoEMethod",
        "mxfp4",
        ("marlin", "humming", "flashinfer_trtllm", "b12x"),
        BLACKWELL,
    ),
    OnlinePath(
        "fp8_per_tensor",
        "Fp8PerTensorOnlineMoEMethod",
        "fp8-tensor",
        ("triton", "marlin"),
    ),
    OnlinePath(
        "fp8_per_channel",
        "Fp8PtpcOnlineMoEMethod",
        "fp8-channel",
        ("triton", "cutlass", "humming"),
    ),
    OnlinePath(
        "mxfp8", "Mxfp8OnlineMoEMethod", "mxfp8", ("marlin", "triton", "humming")
    ),
    OnlinePath(
        "int8_per_channel_weight_only", "Int8OnlineMoEMethod", "int8", ("humming",)
    ),
    OnlinePath(
        "nvfp4_per_token",
        "Nvfp4OnlineMoEMethod",
        "nvfp4",
        ("flashinfer_trtllm", "flashinfer_cutedsl", "marlin", "humming"),
        BLACKWELL,
    ),
)
# vLLM 0.34's LUT-B (emulated on any GPU but Rubin)
LUT_B = OnlinePath("lut_b_moe", "LutBOnlineMoEMethod", "lut-b", ("emulation",))
if lut_b_online_quantization_exists():
    PATHS += (LUT_B,)
# A checkpoint whose latent projections are FP8 in [128, 128] blocks and
# whose routed experts are BF16 (compressed-tensors targets the projections
# alone): --quantization-config '{"moe": "mxfp4"}' composes with it (vLLM PR
# 51392).
LATENT_FP8_BLOCK = json.dumps(
    {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": [],
        "config_groups": {
            "latent_projections": {
                "targets": [r"re:.*routed_expert_(up|down)_proj"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": "block",
                    "block_structure": [128, 128],
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": True,
                    "strategy": "group",
                    "group_size": 128,
                },
                "format": "float-quantized",
            }
        },
    }
)
COMPOSED = (
    OnlinePath(
        "mxfp4",
        "Mxfp4OnlineMoEMethod",
        "mxfp4",
        ("marlin",),
        BLACKWELL,
        checkpoint=LATENT_FP8_BLOCK,
    ),
)

# Other spellings of the same methods: --quantization fp8 (deprecated, FP8 per
# tensor) and experts_int8 (vLLM's older INT8 config, the same method)
ALIASES = {"fp8": "fp8_per_tensor", "experts_int8": "int8_per_channel_weight_only"}

# Each layout the issue names, and the checkpoint rows of every expert each
# GPU holds: 3072 split over TP x DP.
LAYOUTS = (
    (Topology(8), 384),  # vLLM alone allocates 384: no pad
    (Topology(16), 192),  # vLLM alone allocates 256 (its model-level 256 / TP)
    (Topology(32), 96),  # 256
    (Topology(16, dp_size=2), 96),  # 128 (4096 over 32 GPUs)
    (Topology(8, dp_size=4), 96),  # 96, where the method does not round it
    (Topology(4, dp_size=8), 96),  # 96, likewise
)


@dataclass
class Quantized:
    """What the method was given and produced for a GPU: the BF16 weights
    as its ``process_weights_after_loading`` found them (``w13``, ``w2``:
    loaded, materialised, and zeroed by the plugin where it does), and w13's
    and w2's quantized values and scales as it handed them to its kernel's
    preparation (``_setup_kernel``; LUT-B's emulation has none)."""

    bf16: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    # what vLLM 0.34's direct-mode reload would zero-fill, asked before the
    # method processed the layer (None on 0.33)
    padding_fill: list[str] | None = None


@dataclass
class QuantizedRank:
    path: OnlinePath
    backend: str
    rank: Rank
    experts: Any  # vLLM's RoutedExperts, quantized and prepared
    quantized: Quantized
    loaded: tuple[Any, Any]  # the BF16 this GPU loaded: w13 [E, 2 x rows, K], w2
    error: Exception | None = None  # what vLLM raised preparing it, if it did


def _clone(tensor: Any) -> Any:
    return None if tensor is None else tensor.detach().clone()


# The layer parameters the INT8 and NVFP4 methods quantize into before their
# ``_setup_kernel(layer)`` reads them (the FP8, MXFP4 and MXFP8 methods pass
# theirs as arguments).
_QUANTIZED_PARAMETERS = {
    "Int8OnlineMoEMethod": ("weight", "scale", None),
    "Nvfp4OnlineMoEMethod": ("weight", "weight_scale", "weight_scale_2"),
}


def _online_methods() -> list[type]:
    """Every online MoE method class (its module imported: the online
    config's imports them all)."""
    import vllm.model_executor.layers.quantization.online.base  # noqa: F401
    from vllm.model_executor.layers.quantization.online.moe_base import (
        OnlineMoEMethodBase,
    )

    found, todo = [], [OnlineMoEMethodBase]
    while todo:
        for cls in todo.pop().__subclasses__():
            found.append(cls)
            todo.append(cls)
    return found


@contextlib.contextmanager
def online_methods_observed(into: Quantized) -> Iterator[None]:
    """Every online method's own ``process_weights_after_loading`` records
    the BF16 weights it is handed into ``into`` and runs with the
    preparation stand-ins (``stand_ins.on_cpu``: its kernel's modules are
    imported by then) and one GPU for the data-parallel group (as
    ``harness.PreparedOnCpu`` prepares); its ``_setup_kernel`` records the
    quantized tensors. Both then run as they are."""
    with contextlib.ExitStack() as stack:
        for cls in _online_methods():
            own = cls.__dict__.get("process_weights_after_loading")
            if own is not None:
                stack.enter_context(
                    replaced_attributes(
                        cls, process_weights_after_loading=_observed(own, into)
                    )
                )
            own = cls.__dict__.get("_setup_kernel")
            if own is not None:
                stack.enter_context(
                    replaced_attributes(cls, _setup_kernel=_reading(own, into))
                )
        yield


def _observed(own: Any, into: Quantized) -> Any:
    @functools.wraps(own)
    def process_weights_after_loading(self: Any, layer: Any) -> Any:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
            one_gpu_for_the_data_parallel_group,
        )

        # the layer's own, not the plugin's scratch expert (``online.
        # quantized_tensors``: what the method quantizes to, run while the
        # layer is built)
        held = isinstance(layer, RoutedExperts) and not layer.w13_weight.is_meta
        if not into.bf16 and held:
            into.bf16 = {"w13": _clone(layer.w13_weight), "w2": _clone(layer.w2_weight)}
            into.padding_fill = moe_padding_fill_params(layer)
        with stand_ins.on_cpu(), one_gpu_for_the_data_parallel_group(self.moe):
            return own(self, layer)

    return process_weights_after_loading


def _reading(own: Any, into: Quantized) -> Any:
    @functools.wraps(own)
    def _setup_kernel(self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        names = _QUANTIZED_PARAMETERS.get(type(self).__name__)
        if names is None:  # (w13, w2, w13_scale, w2_scale, ...)
            w13, w2, w13_scale, w2_scale = args[:4]
            into.tensors = {
                "w13": _clone(w13),
                "w2": _clone(w2),
                "w13_scale": _clone(w13_scale),
                "w2_scale": _clone(w2_scale),
            }
        else:
            weight, scale, scale_2 = names
            into.tensors = {
                f"{p}{suffix}": _clone(getattr(layer, f"{p}_{name}"))
                for p in ("w13", "w2")
                for suffix, name in (
                    ("", weight),
                    ("_scale", scale),
                    ("_scale_2", scale_2),
                )
                if name is not None
            }
        return own(self, layer, *args, **kwargs)

    return _setup_kernel


_WORKDIR = tempfile.TemporaryDirectory(prefix="kimi-k3-online-")


@functools.cache
def bf16_layer(checkpoint: str | None = None) -> PreparedLayer:
    """The layer every rank loads: BF16 experts (the selftest's synthetic
    tensors: seeded, finite, never zero), 4 of the real 3072 rows, in a
    checkpoint quantized as ``checkpoint`` says elsewhere (JSON; None: not
    at all)."""
    import torch

    shape = moe_shape(FEW_EXPERTS, Topology(1), reduced_width=True)
    workdir = Path(_WORKDIR.name) / ("composed" if checkpoint else "bf16")
    config = None if checkpoint is None else json.loads(checkpoint)
    write_layer_config(workdir, FEW_EXPERTS, shape, config)
    fmt = recognise(None, None, "bf16")
    tensors = expert_tensors(fmt, shape)
    unrouted = SimpleNamespace(bias=torch.zeros(shape.experts))
    return PreparedLayer(shape, fmt, workdir, tensors, unrouted, torch.empty(0))


@contextlib.contextmanager
def _quantizing(path: OnlinePath, into: Quantized) -> Iterator[None]:
    """While a rank is built, loaded and prepared (the layerwise loader
    quantizes a layer as its last checkpoint tensor arrives where it has no
    pad, after loading where it has): every allocation vLLM leaves unwritten
    reads 0x7F bytes (3.4e38), the GPU is of the path's capability, and the
    method is observed (``online_methods_observed``)."""
    with (
        uninitialised_memory_reads(HUGE_BYTE),
        a_cuda_node(8, path.capability),
        stand_ins.loading(),
        online_methods_observed(into),
    ):
        yield


def quantize_rank(
    kimi_model: ModuleType,
    path: OnlinePath,
    backend: str,
    rank: Rank,
    *,
    alone: bool = False,
) -> QuantizedRank:
    """``rank`` of ``path`` on ``backend`` (the plugin's, or vLLM alone's with
    ``alone``) built, loaded, quantized and prepared; where vLLM raises
    preparing it, the error, with what the method had produced by then."""
    layer = bf16_layer(path.checkpoint)
    case = SelftestCase(
        "bf16", rank.topology, backend, FEW_EXPERTS, None, path.online()
    )
    into = Quantized()
    experts, error = None, None
    with (
        vllm_alone(kimi_model) if alone else contextlib.nullcontext(),
        _quantizing(path, into),
    ):
        try:
            with loaded_rank(PreparedOnCpu(), case, kimi_model, layer, rank) as loaded:
                experts = loaded.experts
        except Exception as raised:  # vLLM's own refusal, kept
            error = raised
    return QuantizedRank(
        path, backend, rank, experts, into, loaded_bf16(layer, rank), error
    )


def gpu_of(rank: Rank) -> tuple[int, int]:
    """This GPU's place among the GPUs sharding every expert, and how many
    there are: vLLM flattens TP x DP (``dp x TP + tp``) without expert
    parallelism."""
    topology = rank.topology
    return rank.dp_rank * topology.tp_size + rank.tp_rank, topology.moe_group


def loaded_bf16(layer: PreparedLayer, rank: Rank) -> tuple[Any, Any]:
    """The checkpoint rows ``rank`` holds, every expert: its even slice of
    the rows over the GPUs sharding them."""
    import torch

    from vllm_kimi_k3_moe.tools.selftest.checkpoint import expert_key

    gpu, gpus = gpu_of(rank)
    rows = layer.shape.intermediate // gpus
    held = slice(gpu * rows, (gpu + 1) * rows)
    w13, w2 = [], []
    for expert in range(layer.shape.experts):
        gate, up, down = (
            layer.tensors[expert_key(expert, projection, "weight")]
            for projection in ("w1", "w3", "w2")
        )
        w13.append(torch.cat([gate[held], up[held]]))
        w2.append(down[:, held])
    return torch.stack(w13), torch.stack(w2)


def kernel_names(method: Any) -> tuple[str, ...]:
    """The kernel ``method`` runs (``partition.kernel_of``), by name."""
    return tuple(getattr(part, "__name__", str(part)) for part in kernel_of(method))


def kernel(quantized: QuantizedRank) -> tuple[str, ...]:
    return kernel_names(quantized.experts.quant_method)


def refusal(quantized: QuantizedRank) -> str:
    return f"{type(quantized.error).__name__}: {quantized.error}"


def what_is_wrong(quantized: QuantizedRank) -> list[str]:
    """What is wrong with what a GPU's method quantized (nothing: right)."""
    if quantized.experts is None and not quantized.quantized.tensors:
        return [f"nothing quantized ({refusal(quantized)})"]
    return quantization_problems(
        quantized.path.format,
        quantized.quantized.tensors,
        quantized.experts,
        quantized.loaded,
    )
