"""The all-reduce online quantization runs over the GPUs that shard a weight.

``torch.distributed.all_reduce`` (``quant_utils.amax_for_moe_weight_quant``,
``amax_for_tp_weight_quant``)
    vLLM's online FP8 per tensor and per channel, INT8 and NVFP4 methods take
    the maximum of each expert's weights (or of w2's rows), and online FP8
    per tensor that of a tensor-parallel linear layer's weight, over the GPUs
    sharding it (the EP group: TP x DP; the TP group), so that every GPU
    quantizes with the scale of the whole weight. One process posing as one
    GPU has no process group and no other GPU. The stand-in keeps this GPU's
    own maximum (an all-reduce over a group of one).
    On CPU tensors (the test suite) the GPU's rows then quantize with a
    scale at most the whole expert's, each within its format's error of the
    BF16 it loaded, which is what the tests hold them to; a pad this GPU
    leaves unwritten still enters its maximum (another GPU's pad, which the
    real all-reduce would spread here, is that GPU's own test). On ``meta``
    (``plan``) there are no values: an all-reduce changes no shape or dtype,
    which is all a ``meta`` tensor has.
    The group stand-ins (``rank.simulated_rank``) have no ``device_group``:
    ``get_ep_group`` and ``get_tp_group`` are answered, for ``quant_utils``
    only, by one with ``device_group`` None.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


@dataclass(frozen=True)
class _GroupOfOne:
    device_group: Any = None


def _all_reduce_over_one_gpu(
    tensor: Any, op: Any = None, group: Any = None, async_op: bool = False
) -> None:
    """What an all-reduce over a group of one GPU computes: the tensor as it
    is."""
    assert not async_op, "online quantization's all-reduce is synchronous"


@contextmanager
def all_reduce_over_one_gpu() -> Iterator[None]:
    """The all-reduce and the groups above, for the block."""
    import torch
    from vllm.model_executor.layers.quantization.utils import quant_utils

    with (
        replaced_attributes(torch.distributed, all_reduce=_all_reduce_over_one_gpu),
        replaced_attributes(
            quant_utils, get_ep_group=_GroupOfOne, get_tp_group=_GroupOfOne
        ),
    ):
        yield


# the name each family of the test suite's stand-ins enters them by
stand_ins = all_reduce_over_one_gpu
