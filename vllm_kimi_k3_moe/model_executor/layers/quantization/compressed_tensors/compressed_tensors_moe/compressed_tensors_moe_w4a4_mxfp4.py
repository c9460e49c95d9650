"""Kimi-K3 on compressed-tensors MXFP4: the MoE method pads for its own kernel.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.layers.quantization.compressed_tensors.
    compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4.
    CompressedTensorsW4A4Mxfp4MoEMethod`` (by a subclass of itself, which
    vLLM's compressed-tensors MoE dispatch picks up because it imports the
    class from that module when a layer is built).
Affects
    Only routed experts built inside a Kimi-K3 NVIDIA ``KimiMoE`` (main model
    and MTP draft), on compressed-tensors MXFP4 checkpoints whose format is not
    ``mxfp4-pack-quantized`` (that one is rewritten to native MXFP4 and takes
    ``Mxfp4MoEMethod``, which pads on its own). Every other model using this
    method gets upstream's behaviour: the overrides defer to upstream whenever
    no ``KimiMoE`` is being built.
Why
    With the model-level padding gone (``vllm_kimi_k3_moe.models.kimi_k3.
    nvidia.model``), this method receives the logical per-rank size, and
    upstream neither rounds it for its kernel (it has no
    ``maybe_roundup_sizes``) nor zero-fills (``torch.empty``). A TP32 rank
    would get a 96-wide partition, which no MXFP4 Marlin MoE thread tile
    accepts; and before the plugin, the 256-wide model-level pad was
    uninitialised memory read by the GEMM.
How
    ``maybe_roundup_sizes`` rounds the per-rank intermediate with vLLM's MXFP4
    sizing oracle (``mxfp4_round_up_hidden_size_and_intermediate_size``) for
    the kernel this method selected (Marlin: multiple of 128, CUTLASS: 128,
    b12x / FlashInfer EP: exact). The hidden size is returned unchanged: the
    generic loader cannot place a padded hidden dimension, and Kimi-K3's 3584
    already meets every kernel's hidden alignment. When that rounding padded
    the partition, ``create_weights`` zero-fills the four expert tensors, so
    the tail beyond the valid region is zero before and after loading. A
    partition that is already aligned gets exactly upstream's allocation.
Related PR
    The same vLLM PR as the model patch: "Kimi-K3 NVIDIA: delegate regular
    FusedMoE padding to the selected quantization backend" (its backends must
    own their padding).
Delete when
    Together with the model patch: the vLLM release that ships that PR (the
    plugin refuses anything but vLLM 0.33.x).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import building_kimi_moe

EXPERT_TENSORS = (
    "w13_weight_packed",
    "w2_weight_packed",
    "w13_weight_scale",
    "w2_weight_scale",
)


class KernelPaddedCompressedTensorsMxfp4:
    """Placed in front of upstream's method class in the patched class's MRO."""

    def kernel_backend(self) -> Any:
        """The ``Mxfp4MoeBackend`` whose kernel will run these weights."""
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

        if self.use_cutlass_mxfp4:
            return Mxfp4MoeBackend.CUTLASS_MXFP4_MXFP4
        return self.mxfp4_backend

    def maybe_roundup_sizes(
        self,
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: Any,
    ) -> tuple[int, int]:
        hidden_size, intermediate_size_per_partition = super().maybe_roundup_sizes(
            hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config
        )
        if not building_kimi_moe():
            return hidden_size, intermediate_size_per_partition
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
            mxfp4_round_up_hidden_size_and_intermediate_size,
        )

        _, padded = mxfp4_round_up_hidden_size_and_intermediate_size(
            self.kernel_backend(),
            hidden_size,
            intermediate_size_per_partition,
            activation=self.moe.activation,
        )
        return hidden_size, padded

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        super().create_weights(
            layer,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            params_dtype,
            **extra_weight_attrs,
        )
        valid = self.moe.intermediate_size_per_partition_unpadded
        if building_kimi_moe() and intermediate_size_per_partition != valid:
            # Upstream allocates with torch.empty; the kernel reads the tail.
            for name in EXPERT_TENSORS:
                getattr(layer, name).data.zero_()


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    method = upstream.CompressedTensorsW4A4Mxfp4MoEMethod
    if issubclass(method, KernelPaddedCompressedTensorsMxfp4):
        return
    upstream.CompressedTensorsW4A4Mxfp4MoEMethod = type(
        method.__name__,
        (KernelPaddedCompressedTensorsMxfp4, method),
        {
            "__module__": upstream.__name__,
            "__qualname__": method.__qualname__,
            "__doc__": "Upstream method; pads Kimi-K3 routed experts for its "
            "kernel (patched by vllm-kimi-k3-moe).",
        },
    )
