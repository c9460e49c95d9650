"""Kimi-K3 routed experts load strictly: malformed or incomplete checkpoints fail.

Patch ledger entry
------------------
Replaces
    For the routed experts of each Kimi-K3 NVIDIA ``KimiMoE`` (main model and
    MTP draft) on an MXFP4 quantization method (``Mxfp4MoEMethod`` and its
    subclasses, ``CompressedTensorsW4A4Mxfp4MoEMethod``): the ``weight_loader``
    attribute of each expert weight and scale parameter (upstream: the bound
    ``RoutedExperts.weight_loader``) and the layer's
    ``quant_method.process_weights_after_loading``. Both are instance
    attributes; no vLLM class or other model is touched.
Why
    vLLM 0.33.0's generic expert loader narrows or partially copies
    wrong-sized checkpoint tensors without a word (an intermediate of 2048,
    3000 or 4096 instead of 3072 loads "fine"), and nothing notices an expert
    tensor that was never loaded: the layer then serves zeros or garbage for
    that expert.
How
    Before upstream's loader runs, the checkpoint tensor's shape is compared
    with the logical expert shape (w1/w3 ``[moe_intermediate_size, hidden]``,
    w2 ``[hidden, moe_intermediate_size]``; MXFP4 packs the last dimension two
    values per byte and keeps one scale byte per 32 values); a mismatch raises
    ``ValueError`` naming the checkpoint tensor, the expert and both shapes,
    before any byte is copied. Valid tensors are handed on as they are. Each
    slice (expert x w1/w2/w3 x weight/scale) written on this rank is recorded;
    a second write raises before copying. Just before the quantization method
    post-processes the layer, slices never written raise ``ValueError``
    listing them. A layer that received no expert tensor at all is left alone
    unless another Kimi-K3 layer in the process did (dummy weights, tensorizer
    and pre-processed weight caches fill parameters without the loader).
Related PR
    None upstream: vLLM's generic loader has the same gap for every MoE model;
    this plugin closes it for Kimi-K3, whose 1.56 TB checkpoint makes a
    silently wrong expert costly to find.
Delete when
    vLLM's ``RoutedExperts.weight_loader`` validates expert shapes and
    completeness itself; re-check at every vLLM bump (the plugin refuses
    anything but vLLM 0.33.x).
"""

from __future__ import annotations

import re
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_kimi_k3_moe.mxfp4_expert_layout import expert_tensor_shape

# Expert parameters of the MXFP4 methods: "w13_weight_packed" -> (w13, weight_packed)
_EXPERT_PARAMETER = re.compile(r"(w13|w2)_(weight(?:_packed|_scale)?)")

_loaded_layers: weakref.WeakSet[StrictExpertLoading] = weakref.WeakSet()


@dataclass(frozen=True, order=True, slots=True)  # ~5k per layer while loading
class ExpertSlice:
    """One checkpoint tensor of one expert, as this rank holds it."""

    expert_id: int
    shard: str  # w1 (gate), w3 (up), w2 (down)
    suffix: str  # weight, weight_packed or weight_scale

    def __str__(self) -> str:
        return f"{self.expert_id}.{self.shard}.{self.suffix}"


class StrictExpertLoading:
    """Shape checks and a write ledger for one Kimi-K3 ``RoutedExperts``."""

    def __init__(self, experts: nn.Module, moe_intermediate_size: int) -> None:
        self.experts = experts
        self.layer_name: str = experts.layer_name
        self.hidden_size: int = experts.moe_config.hidden_dim_unpadded
        self.intermediate_size = moe_intermediate_size
        # (shard, suffix) of every checkpoint tensor an expert of this layer has
        self.expert_tensors: list[tuple[str, str]] = []
        self.written: set[ExpertSlice] = set()

    def checkpoint_name(self, expert_slice: ExpertSlice) -> str:
        """The name vLLM's Kimi-K3 expert mapping reads this slice from."""
        return f"{self.layer_name}.{expert_slice}"

    def expected_shape(self, expert_slice: ExpertSlice) -> tuple[int, int]:
        return expert_tensor_shape(
            expert_slice.shard,
            expert_slice.suffix,
            self.hidden_size,
            self.intermediate_size,
        )

    def is_local(self, expert_id: int) -> bool:
        return bool(self.experts.expert_map_manager.is_local_expert(expert_id))

    def loader_for(self, suffix: str) -> Callable[..., Any]:
        """The ``weight_loader`` for the expert parameter whose checkpoint
        tensors end in ``suffix`` (weight, weight_packed or weight_scale)."""

        def weight_loader(
            param: nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool | None:
            expert_slice = ExpertSlice(expert_id, shard_id, suffix)
            self.check_shape(expert_slice, loaded_weight, weight_name)
            local = self.is_local(expert_id)
            if local and expert_slice in self.written:
                raise ValueError(
                    f"Kimi-K3 checkpoint tensor {self.checkpoint_name(expert_slice)}"
                    f" (expert {expert_id}, into {weight_name}) is loaded a second"
                    " time; the checkpoint must hold each expert tensor once."
                )
            result = self.experts.weight_loader(
                param,
                loaded_weight,
                weight_name,
                shard_id=shard_id,
                expert_id=expert_id,
                return_success=return_success,
            )
            if local:
                self.written.add(expert_slice)
                _loaded_layers.add(self)
            return result

        return weight_loader

    def check_shape(
        self, expert_slice: ExpertSlice, loaded_weight: torch.Tensor, weight_name: str
    ) -> None:
        expected = self.expected_shape(expert_slice)
        actual = tuple(loaded_weight.shape)
        if actual != expected:
            raise ValueError(
                f"Kimi-K3 checkpoint tensor {self.checkpoint_name(expert_slice)} "
                f"(expert {expert_slice.expert_id}, loaded into {weight_name}) has "
                f"shape {actual}, expected {expected} for moe_intermediate_size="
                f"{self.intermediate_size} and expert hidden size "
                f"{self.hidden_size} in MXFP4."
            )

    def expected_slices(self) -> set[ExpertSlice]:
        """Every slice this rank must receive: its local experts' tensors."""
        local = [e for e in range(self.experts.global_num_experts) if self.is_local(e)]
        return {
            ExpertSlice(expert, shard, suffix)
            for shard, suffix in self.expert_tensors
            for expert in local
        }

    def missing(self) -> list[ExpertSlice]:
        return sorted(self.expected_slices() - self.written)

    def check_complete(self) -> None:
        """Raise ``ValueError`` listing the expert tensors never loaded."""
        if not self.written and not _loaded_layers:
            return  # Filled without the loader (dummy, tensorizer, caches).
        missing = self.missing()
        if missing:
            raise ValueError(
                f"Kimi-K3 layer {self.layer_name}: {len(missing)} routed-expert "
                f"checkpoint tensors were never loaded: {_describe(missing)}. "
                "The checkpoint is incomplete."
            )


def _describe(missing: list[ExpertSlice], max_experts: int = 16) -> str:
    by_expert: dict[int, list[str]] = defaultdict(list)
    for expert_slice in missing:
        by_expert[expert_slice.expert_id].append(
            f"{expert_slice.shard}.{expert_slice.suffix}"
        )
    shown = [
        f"expert {expert} ({', '.join(tensors)})"
        for expert, tensors in list(by_expert.items())[:max_experts]
    ]
    if len(by_expert) > max_experts:
        shown.append(f"and {len(by_expert) - max_experts} more experts")
    return "; ".join(shown)


def _strict_method(quant_method: Any) -> bool:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4 import (  # noqa: E501
        CompressedTensorsW4A4Mxfp4MoEMethod,
    )
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    return isinstance(
        quant_method, (Mxfp4MoEMethod, CompressedTensorsW4A4Mxfp4MoEMethod)
    )


def make_expert_loading_strict(kimi_moe: nn.Module, moe_intermediate_size: int) -> None:
    """Install strict loading on the MXFP4 routed experts inside ``kimi_moe``."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    for experts in kimi_moe.modules():
        if isinstance(experts, RoutedExperts) and _strict_method(experts.quant_method):
            _install(experts, moe_intermediate_size)


def _install(experts: nn.Module, moe_intermediate_size: int) -> None:
    loading = StrictExpertLoading(experts, moe_intermediate_size)
    for name, param in experts.named_parameters(recurse=False):
        match = _EXPERT_PARAMETER.fullmatch(name)
        if match is None:
            continue
        stem, suffix = match.groups()
        shards = ("w1", "w3") if stem == "w13" else ("w2",)
        loading.expert_tensors += [(shard, suffix) for shard in shards]
        param.weight_loader = loading.loader_for(suffix)

    quant_method = experts.quant_method
    process_weights = quant_method.process_weights_after_loading

    def process_weights_after_loading(layer: nn.Module) -> None:
        loading.check_complete()
        loading.written.clear()  # A later reload starts a fresh ledger.
        process_weights(layer)

    quant_method.process_weights_after_loading = process_weights_after_loading
    experts.kimi_k3_expert_loading = loading


def expert_loading(experts: nn.Module) -> StrictExpertLoading | None:
    """The strict-loading ledger of a Kimi-K3 ``RoutedExperts``, if installed."""
    return getattr(experts, "kimi_k3_expert_loading", None)
