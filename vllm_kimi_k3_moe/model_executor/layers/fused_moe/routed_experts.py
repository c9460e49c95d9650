"""Kimi-K3 routed experts: each quantization method gets its kernel's smallest
per-rank partition, never more than vLLM alone allocates, with a zero pad.

Patch ledger entry
------------------
Replaces
    ``vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.
    _get_quant_method`` (class attribute; a wrapper that calls it). Only while
    a Kimi-K3 NVIDIA ``KimiMoE`` is being built (main model and MTP draft)
    does the wrapper act: it sets two instance attributes on the quantization
    method it returns, ``maybe_roundup_sizes`` and ``create_weights``, which
    defer to the method's own. Every other model's layers, and these methods
    outside the build, behave as upstream.
Why
    With the model-level padding gone (``vllm_kimi_k3_moe.models.kimi_k3.
    nvidia.model``) each method receives the logical per-rank size (96 at
    TP32). Only some own their padding: the FP8 block method refuses 96 and
    192 (``create_weights``: not divisible by ``block_n`` 128) where vLLM
    alone starts, the compressed-tensors MXFP4 method hands Marlin a 96 it
    cannot run, and a method nobody has looked at may do anything. And vLLM
    alone's pads are uninitialised memory for the methods that allocate with
    ``torch.empty``: the kernel multiplies through them.
How
    ``RoutedExperts.__init__`` asks the method's ``maybe_roundup_sizes`` for
    the per-rank partition, then calls ``create_weights``. During a Kimi-K3
    build the first answers, from the partition rule of the method's format
    (``vllm_kimi_k3_moe.formats``): the
    smallest partition the method's kernel accepts (each rule calls the vLLM
    check that enforces it), never above what vLLM alone would allocate (the
    method's own rounding of the model-level size). A method without a rule
    gets exactly vLLM alone's partition. Where the model-level padding does
    not apply (expert parallelism, TP sizes whose slice is at least 256) the
    method's own answer is kept untouched. When the partition exceeds the
    logical slice, ``create_weights`` zero-fills the per-expert tensors it
    made before any weight is loaded (the loader writes only the logical
    rows), so every pad is zero. Each process logs one line per method,
    backend and partition.
Related PR
    The same vLLM PR as the model patch: "Kimi-K3 NVIDIA: delegate regular
    FusedMoE padding to the selected quantization backend" (its backends must
    own their padding; in 0.33.0 not all do).
Delete when
    Together with the model patch, once every method Kimi-K3 is published for
    pads for its own kernel in the vLLM release that ships that PR (the plugin
    refuses anything but vLLM 0.33.x).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from vllm_kimi_k3_moe.formats import format_of_method
from vllm_kimi_k3_moe.formats.record import RoundUp
from vllm_kimi_k3_moe.models.kimi_k3.nvidia.model import (
    KimiMoEBuild,
    current_kimi_moe_build,
)
from vllm_kimi_k3_moe.patching import unwrap_method, wrap_method

logger = logging.getLogger("vllm.plugins.kimi_k3_moe")
_logged: set[str] = set()


@dataclass(frozen=True)
class PartitionChoice:
    """The per-rank partition of one Kimi-K3 routed-experts layer."""

    method: str
    backend: str
    logical: int  # this rank's slice of moe_intermediate_size
    upstream: int  # what vLLM 0.33.0 alone allocates
    allocated: int  # what this plugin allocates
    reason: str

    def log_line(self) -> str:
        return (
            f"vllm-kimi-k3-moe: Kimi-K3 routed experts on {self.method} "
            f"({self.backend}): {self.allocated} intermediate rows per GPU "
            f"(logical {self.logical}, vLLM alone {self.upstream}); {self.reason}"
        )


def choose_partition(
    method: Any, build: KimiMoEBuild, hidden: int, asked: int, round_up: RoundUp
) -> PartitionChoice:
    """The partition for ``method``'s layer in ``build``: ``asked`` is what
    the layer asks the method for, ``round_up(hidden, n)`` the method's own
    rounding of a partition ``n``."""
    logical = method.moe.intermediate_size_per_partition_unpadded
    tp_size = method.moe.moe_parallel_config.tp_size
    own = round_up(hidden, asked)
    if build.model_level_size in (None, build.logical_size):
        upstream, allocated = own, own
        reason = "no model-level padding at this topology: as vLLM alone"
    else:
        # FusedMoEConfig.__post_init__: intermediate_size // tp_size, as vLLM
        # alone computes it from the model-level size it is handed.
        upstream = round_up(hidden, build.model_level_size // tp_size)
        fmt = format_of_method(method)
        if fmt is None:
            allocated = upstream
            reason = "no rule for this method: vLLM alone's partition, zeroed"
        else:
            rule = fmt.partition_rule
            smallest = rule.smallest_partition(method, hidden, own, round_up, upstream)
            allocated = min(smallest, upstream)
            if rule.adopt is not None and allocated == smallest:
                # e.g. FP8 blocks: at TP16 the 256 equals vLLM alone's, but
                # only block-aligned loading puts the right scales in it
                rule.adopt(method)
            reason = f"smallest partition accepted ({rule.name})"
    return PartitionChoice(
        method=type(method).__name__,
        backend=backend_name(method),
        logical=logical,
        upstream=upstream,
        allocated=allocated,
        reason=reason,
    )


BACKEND_ATTRIBUTES = (
    "mxfp4_backend",
    "fp8_backend",
    "nvfp4_backend",
    "wna16_backend",
    "unquantized_backend",
)


def backend_name(method: Any) -> str:
    """The MoE kernel ``method`` selected, as vLLM's backend enums name it."""
    if getattr(method, "use_cutlass_mxfp4", False):
        return "cutlass_mxfp4_mxfp4"
    for attribute in BACKEND_ATTRIBUTES:
        backend = getattr(method, attribute, None)
        if backend is not None:
            return str(getattr(backend, "name", backend)).lower()
    return "unknown backend"


def zero_expert_tensors(layer: torch.nn.Module) -> None:
    """Zero every per-expert weight and scale tensor (``[experts, rows, cols]``
    ``w13_*`` / ``w2_*``) of ``layer``: the loader fills the logical rows of
    each from the checkpoint, the pad stays zero (weights and scales, so it
    dequantizes to zero in every format, INT4's offset nibbles included)."""
    for name, param in layer.named_parameters(recurse=False):
        if name.startswith(("w13_", "w2_")) and param.dim() == 3:
            param.data.zero_()


def _install(method: Any, build: KimiMoEBuild) -> None:
    """Give ``method`` Kimi-K3 sizing for the layer being built."""
    own_round_up = method.maybe_roundup_sizes
    own_create_weights = method.create_weights
    choice: list[PartitionChoice] = []

    @functools.wraps(own_round_up)
    def maybe_roundup_sizes(
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: Any,
    ) -> tuple[int, int]:
        if current_kimi_moe_build() is not build:
            return own_round_up(
                hidden_size,
                intermediate_size_per_partition,
                act_dtype,
                moe_parallel_config,
            )
        hidden = own_round_up(
            hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config
        )[0]

        def round_up(hidden: int, n: int) -> int:
            return own_round_up(hidden, n, act_dtype, moe_parallel_config)[1]

        choice[:] = [
            choose_partition(
                method, build, hidden, intermediate_size_per_partition, round_up
            )
        ]
        line = choice[0].log_line()
        if line not in _logged:
            _logged.add(line)
            logger.info(line)
        return hidden, choice[0].allocated

    @functools.wraps(own_create_weights)
    def create_weights(
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        own_create_weights(
            layer,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            params_dtype,
            **extra_weight_attrs,
        )
        if (
            current_kimi_moe_build() is build
            and choice
            and choice[0].allocated != choice[0].logical
        ):
            zero_expert_tensors(layer)

    method.maybe_roundup_sizes = maybe_roundup_sizes
    method.create_weights = create_weights


def _kimi_k3_get_quant_method(own: Callable) -> Callable:
    @functools.wraps(own)
    def _get_quant_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        method = own(self, *args, **kwargs)
        build = current_kimi_moe_build()
        if build is not None:
            _install(method, build)
        return method

    return _get_quant_method


def apply(upstream: ModuleType) -> None:
    """Install the patch into the imported upstream module (idempotent)."""
    wrap_method(upstream.RoutedExperts, "_get_quant_method", _kimi_k3_get_quant_method)


def revert(upstream: ModuleType) -> None:
    """Put upstream's own ``_get_quant_method`` back (idempotent)."""
    unwrap_method(upstream.RoutedExperts, "_get_quant_method")
