"""The all-reduce online quantization runs over the GPUs that shard an expert.

``torch.distributed.all_reduce`` (``quant_utils.amax_for_moe_weight_quant``)
    vLLM's online FP8 per tensor and per channel, INT8 and NVFP4 methods take
    the maximum of each expert's weights (or of w2's rows) over the GPUs
    sharding it (the EP group: TP x DP), so that every GPU quantizes with the
    scale of the whole expert. One CPU process posing as one GPU has no
    process group and no other GPU. The stand-in keeps this GPU's own maximum
    (an all-reduce over a group of one): the GPU's rows then quantize with a
    scale at most the whole expert's, each within its format's error of the
    BF16 it loaded, which is what the tests hold them to; a pad this GPU
    leaves unwritten still enters its maximum (another GPU's pad, which the
    real all-reduce would spread here, is that GPU's own test). The EP group
    stand-in (``rank.simulated_rank``) has no ``device_group``: ``get_ep_group``
    is answered, for ``quant_utils`` only, by one with ``device_group``
    None.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


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
def stand_ins() -> Iterator[None]:
    import torch
    from vllm.model_executor.layers.quantization.utils import quant_utils

    from vllm_kimi_k3_moe.patching import replaced_attributes

    with (
        replaced_attributes(torch.distributed, all_reduce=_all_reduce_over_one_gpu),
        replaced_attributes(quant_utils, get_ep_group=_GroupOfOne),
    ):
        yield
