"""Humming's compiled weight ops and device queries, kept as values, on a
stand-in Hopper GPU (where vLLM picks Humming by default: SM 9.0).

``humming.device``'s device info (``_get_device_info_extension``,
``torch.cuda.current_device`` behind ``get_device_index``, and
``DeviceInfo`` of the tensors' device, which must be a CUDA one)
    Humming's JIT extension reads the GPU's properties, and the layer
    config, the weight layout and the tile heuristics are chosen for its
    ``sm_version``; the layer's CPU tensors stand for GPU 0's. The stand-in
    answers as an H100 SXM (``HOPPER``): SM 9.0, 132 compute units, 227 KiB
    of shared memory per block; only the heuristics' choice of tile reads
    more than the SM version.
vLLM's ``current_platform.get_device_capability()`` (in
``quantization/utils/humming/schema.py``)
    which activation types the GPU runs decides the input schema: 9.0 here
    (the plugin's ``CudaPlatformStandIn``).
``torch.cuda.device``
    Humming enters the tensors' device around its schema conversions and
    tuning; a no-op here.
``torch.Tensor.cuda``
    the AutoAWQ schema moves the packed weights to the GPU before unpacking
    them (``humming/schema/awq.py``): the tensor itself here.
``humming::repack_weight`` (``humming.ops.repack_weight``)
    humming/include/humming/kernel/process.cuh ``weight_repack_nk``: the
    padded ``[experts, n, k * bits / 32]`` packed codes to the kernel's
    ``[experts, k / pack_k, n * pack_k * bits / 32]`` tiles (pack_k = 256 /
    activation bits), a permutation of the bits for BF16 activations; for
    integer weights with 16-bit activations and more than 7 bits
    (``should_preprocess_for_int2fp``) it also re-encodes each code. The
    stand-in keeps the codes in the op's output shape, row-major, and
    records the call (``REPACKS``); ``unrepacked`` reads them back.
``humming::unpack_weight``, ``humming::pack_weight``
    csrc kernels splitting int32 words into ``bits``-wide codes, lowest bits
    first, and back: the same in torch.
``GroupCoordinator.device`` of the TP group (``loading()``)
    ``MoeWNA16Method``'s weight loader (``moe_wna16_weight_loader``, the
    AutoAWQ/AutoGPTQ fallback on Humming) moves each checkpoint tensor to the
    TP group's GPU before slicing it; the plugin's ``GroupStandIn`` holds no
    device: the CPU here.
``vllm.utils.humming.get_heuristics_config`` (``humming.tune``)
    not a device call: the tile each token count runs with, chosen in Python
    for the device (the stand-in Hopper) when the experts object is made
    (``HummingIndexedExperts.init_humming_moe``). It reads and writes no
    weight, but ranks every candidate tile for each of ~1670 token counts:
    15-40 s per layer on a CPU. The stand-in asks Humming's own heuristics
    for the token counts in ``TOKEN_COUNTS`` only (each up to the next is
    given the same tile) and records them (``TILES``), so that a test can
    hold the tiles to the GEMM's padded shape.
``fused_humming_moe.create_humming_locks``
    the experts' semaphores, ``8 x compute units`` int32 zeros on the GPU:
    on the layer's device here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import CudaPlatformStandIn


@dataclass(frozen=True)
class Hopper:
    """An H100 SXM as Humming's device extension describes it."""

    index: int = 0
    name: str = "NVIDIA H100 80GB HBM3 (stand-in)"
    is_ppu: bool = False
    sm_major: int = 9
    sm_minor: int = 0
    sm_version: int = 90
    sm_count: int = 132
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_registers_per_sm: int = 65536
    l2_cache_size: int = 50 * 1024 * 1024
    l2_cache_size_mb: float = 50.0
    l1_cache_size: int = 256 * 1024
    l1_cache_size_kb: float = 256.0
    default_smem_size: int = 48 * 1024
    max_smem_size: int = 227 * 1024
    max_smem_size_kb: float = 227.0
    memory_clock_khz: int = 2619000
    memory_bus_width: int = 5120
    sm_clock_khz: int = 1980000
    memory_bandwidth_gbps: float = 3352.0
    tensorcore_tops: dict[str, float] = field(default_factory=dict)


HOPPER = Hopper()
REPACKS: list[dict[str, Any]] = []  # every repack's arguments, in order
TOKEN_COUNTS = (1, 8, 64, 512, 4096)
TILES: list[tuple[Any, int, dict[str, Any]]] = []  # (LayerConfig, tokens, tile)


def _tiles(layer_config: Any, **kwargs: Any) -> list[list[Any]]:
    """Humming's heuristics for ``TOKEN_COUNTS``, as the buckets
    ``get_heuristics_config`` returns: ``[first, last, config]``."""
    from humming.tune import get_heuristics_config

    buckets = []
    ends = (*TOKEN_COUNTS[1:], 1 << 30)
    for first, last in zip((0, *TOKEN_COUNTS[1:]), ends, strict=True):
        tokens = max(first, 1)
        tile = get_heuristics_config(layer_config, shape_m=tokens, **kwargs)
        TILES.append((layer_config, tokens, tile))
        buckets.append([first, last, tile])
    return buckets


def _repack_weight(inputs: Any, weight_bits: int, activation_bits: int, **kw: Any):
    assert kw.get("is_weight_packed", True) or inputs.dtype.itemsize == 4
    shape_n, shape_k = inputs.shape[-2], inputs.shape[-1]
    if kw.get("is_weight_packed"):
        shape_k = shape_k * 32 // weight_bits
    pack_k = 64 if kw.get("use_packed_k_layout") else 256 // activation_bits
    shape = (shape_k // pack_k, shape_n * pack_k * weight_bits // 32)
    REPACKS.append(
        dict(kw, weight_bits=weight_bits, activation_bits=activation_bits)
        | {"shape": tuple(inputs.shape)}
    )
    return inputs.contiguous().reshape(*inputs.shape[:-2], *shape)


def unrepacked(repacked: Any, shape_n: int) -> Any:
    """A repacked ``[experts, k / pack_k, n * pack_k * bits / 32]`` weight read
    back as the ``[experts, n, k * bits / 32]`` packed codes it came from."""
    return repacked.reshape(repacked.shape[0], shape_n, -1)


def unpack(inputs: Any, num_bits: int, outputs: Any = None) -> Any:
    """int32 words to ``num_bits``-wide codes, lowest bits first."""
    import torch

    words = inputs.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // num_bits
    shifts = torch.arange(per_word) * num_bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return codes.reshape(*words.shape[:-1], -1).to(torch.int32)


def pack(inputs: Any, num_bits: int, outputs: Any = None) -> Any:
    """``num_bits``-wide codes to int32 words, lowest bits first."""
    import torch

    per_word = 32 // num_bits
    codes = inputs.to(torch.int64) & ((1 << num_bits) - 1)
    codes = codes.reshape(*codes.shape[:-1], -1, per_word)
    words = (codes << (torch.arange(per_word) * num_bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _locks(device: Any) -> Any:
    import torch

    return torch.zeros(HOPPER.sm_count * 8, dtype=torch.int32, device=device)


class _NoDevice(nullcontext):
    def __init__(self, device: Any = None) -> None:
        super().__init__()


def _identity(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@contextmanager
def on_hopper() -> Iterator[None]:
    """Humming's and vLLM's device queries answering as ``HOPPER``, for the
    block (a prepared layer's ``LayerConfig`` reads some of its properties
    from the current device)."""
    import humming.device
    import torch
    from vllm.model_executor.layers.quantization.utils.humming import schema

    hopper = CudaPlatformStandIn(schema.current_platform, (HOPPER.sm_major, 0))
    extension = SimpleNamespace(_DeviceInfo=lambda index: HOPPER)
    new = humming.device.DeviceInfo.__new__

    def on_gpu_0(cls: type, index: Any = None) -> Any:
        if isinstance(index, torch.device) and index.type != "cuda":
            index = 0
        return new(cls, index)

    device_infos = dict(humming.device.DeviceInfo._instances)
    current = humming.device.current_device
    value = current._value
    humming.device.DeviceInfo._instances.clear()
    current._value = None
    try:
        with ExitStack() as stack:
            stack.enter_context(
                replaced_attributes(
                    humming.device, _get_device_info_extension=lambda: extension
                )
            )
            stack.enter_context(
                replaced_attributes(
                    humming.device.DeviceInfo, __new__=staticmethod(on_gpu_0)
                )
            )
            stack.enter_context(
                replaced_attributes(
                    torch.cuda, device=_NoDevice, current_device=lambda: 0
                )
            )
            stack.enter_context(replaced_attributes(schema, current_platform=hopper))
            yield
    finally:
        humming.device.DeviceInfo._instances.clear()
        humming.device.DeviceInfo._instances.update(device_infos)
        current._value = value


@contextmanager
def ops() -> Iterator[None]:
    """Humming's weight ops (``repack_weight``, ``unpack_weight``,
    ``pack_weight``) for the block."""
    import humming.ops

    with replaced_attributes(
        humming.ops,
        repack_weight=_repack_weight,
        unpack_weight=unpack,
        pack_weight=pack,
    ):
        yield


@contextmanager
def stand_ins() -> Iterator[None]:
    """Humming's ops and device queries, for the block."""
    import torch
    import vllm.utils.humming
    from vllm.model_executor.layers.fused_moe.experts import fused_humming_moe

    REPACKS.clear()
    TILES.clear()
    with ExitStack() as stack:
        stack.enter_context(on_hopper())
        stack.enter_context(ops())
        stack.enter_context(
            replaced_attributes(vllm.utils.humming, get_heuristics_config=_tiles)
        )
        stack.enter_context(replaced_attributes(torch.Tensor, cuda=_identity))
        stack.enter_context(
            replaced_attributes(fused_humming_moe, create_humming_locks=_locks)
        )
        yield


@contextmanager
def loading() -> Iterator[None]:
    """The TP group's device, while a rank's weights are loaded."""
    import torch

    from vllm_kimi_k3_moe.tools.meta_rank.rank import GroupStandIn

    with replaced_attributes(GroupStandIn, device=torch.device("cpu")):
        yield
