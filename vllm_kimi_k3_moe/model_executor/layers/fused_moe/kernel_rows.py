"""Which rows a GPU's MoE kernel keeps: the rules the layout chooser
(``partition.LayoutChooser``) asks, in one place.

- Where a method's rule comes from (``rule_of``): its format's, in the
  registry (``vllm_kimi_k3_moe.formats``: each calls the vLLM check that
  enforces it), else, for an online method, one learned from what it
  quantizes to (``online.quantized_rule``), else one learned from its own
  ``create_weights`` (``learned_rule``); None: no rule.
- What its kernel keeps and takes of a partition: some of vLLM 0.33.0's MoE
  kernels pad each expert's intermediate rows again in
  ``process_weights_after_loading``, into a new tensor that then stays
  resident (the allocated one is held too while they copy): the plugin
  allocates what they keep instead (``resident``). Each multiple here is
  what vLLM's preparation code pads to, and the preparation tests
  (``tests/models/kimi_k3/preparation``) run that code on the CPU at every
  partition the plugin chooses and hold the rows it keeps to the plugin's
  allocation.
- Which partitions the chooser tries, smallest first (``search``).

A format's rule is a record (``formats.record.PartitionRule``: the check it
calls, its row group, whether its pads keep zero scales); what a kernel does
with a method's rows is asked here, whatever the format.

vLLM's own helpers are imported inside the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vllm_kimi_k3_moe.formats import format_of_method
from vllm_kimi_k3_moe.formats.record import PartitionRule, whole_group_partition
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.learned_rule import learned_rule
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import (
    is_online,
    quantized_rule,
)

RoundUp = Callable[[int], int]  # n -> the method's own rounding of n

# Partitions that split no scale group are searched in steps of the finest
# quantization group Kimi-K3 is published with (NVFP4: 16 values per scale).
SEARCH_STEP = 16

# Humming, every format: ``quantization/utils/humming/moe.py``
# ``_prepare_and_transform_sublayer`` pads w13's outputs (2 x rows) to a
# multiple of 256 and w2's inputs (the rows) to 128.
HUMMING_ROWS = 128
# NVFP4's gated kernels pad each of gate and up to a multiple of 64:
# ``flashinfer_fp4_moe`` (``align_fp4_moe_weights_for_fi(min_alignment=64)``
# for FlashInfer TRT-LLM and CuteDSL) and ``b12x_moe._pad_gated_weights``.
GATED_FP4_ROWS = 64
NVFP4_PADDING_GATED = ("flashinfer_trtllm", "flashinfer_cutedsl", "b12x")
# Marlin, every format, pads the rows to its thread tiles, a whole number of
# the format's groups along them (``marlin_moe_padded_intermediate``, which
# ``int_wna16``, ``marlin_utils_fp8`` and ``marlin_utils_fp4`` call or
# restate for widths that are a multiple of 128, as Kimi-K3's 3584).
MARLIN = ("marlin", "batched_marlin")
# vLLM's CUTLASS grouped GEMM for FP8 (``TritonOrCutlassExperts``) reads its
# operands 128 bits at a time along K (csrc grouped_mm_c3x.cuh: AlignmentAB =
# 128 / 8 bits): w2's K is the rows, so a partition of rows not a multiple of
# 16 FP8 values is refused by the kernel, not padded.
CUTLASS_FP8_ROWS = 16

# Where vLLM 0.33.0's MoE methods keep the backend they selected.
BACKEND_ATTRIBUTES = (
    "mxfp4_backend",
    "fp8_backend",
    "nvfp4_backend",
    "mxfp8_backend",
    "wna16_backend",
    "wna16_moe_backend",
    "int8_backend",
    "w4a8_backend",
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


def kernel_keeps(method: Any, n: int, group: int) -> int:
    """The rows ``method``'s kernel keeps of a partition of ``n`` once its
    weight preparation ran; ``group``: the rows that share a scale (or a
    packed element) along them."""
    from vllm.utils.math_utils import round_up

    backend = backend_name(method)
    if backend in MARLIN:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_moe_padded_intermediate,
        )

        return marlin_moe_padded_intermediate(n, group)
    if backend == "humming":
        return round_up(n, HUMMING_ROWS)
    if backend in NVFP4_PADDING_GATED and hasattr(method, "nvfp4_backend"):
        return round_up(n, GATED_FP4_ROWS)
    return n


def kernel_takes(method: Any, n: int) -> bool:
    """Whether ``method``'s kernel runs a partition of ``n`` rows at all
    (where no check of vLLM's refuses it before)."""
    if backend_name(method) == "vllm_cutlass" and hasattr(method, "fp8_backend"):
        return n % CUTLASS_FP8_ROWS == 0
    return True


def rule_of(method: Any, config: Any) -> PartitionRule | None:
    """The partition rule of vLLM's MoE quantization ``method`` (built for
    ``config``): its format's, or one learned from the method itself (for an
    online method, from what it quantizes to); None where none can be had."""
    fmt = format_of_method(method)
    if fmt:
        return fmt.partition_rule
    if is_online(method):
        return quantized_rule(method)
    return learned_rule(method, config)


def resident(rule: PartitionRule, method: Any, n: int) -> int:
    """The rows ``method``'s kernel keeps once its weight preparation ran on
    a partition of ``n`` (some pad again there, holding a second copy while
    they do: ``kernel_keeps``). The plugin allocates only partitions kept as
    they are, so nothing is padded twice."""
    return kernel_keeps(method, n, rule.row_group(method))


def search(
    rule: PartitionRule,
    method: Any,
    hidden: int,
    logical: int,
    limit: int,
    round_up: RoundUp,
) -> tuple[bool, int, Iterator[int]]:
    """Where the chooser looks for a GPU's partition, given its even slice
    (``logical``): whether the GPU holds whole groups instead (the slice
    splits a group of the checkpoint's), the rule's row group, and the
    partitions up to ``limit`` that ``partitions`` yields, smallest first."""
    group = rule.row_group(method)
    whole_groups = rule.groups_in_checkpoint and logical % group != 0
    if whole_groups:
        start, step = whole_group_partition(logical, group), group
    else:
        start, step = round_up(logical), SEARCH_STEP
    candidates = partitions(rule, method, hidden, start, step, limit, round_up)
    return whole_groups, group, candidates


def partitions(
    rule: PartitionRule,
    method: Any,
    hidden: int,
    start: int,
    step: int,
    limit: int,
    round_up: RoundUp,
) -> Iterator[int]:
    """Every n from ``start`` to ``limit``, in steps of ``step``, that the
    method's own rounding and its kernel's preparation leave as it is, that
    its kernel takes and that the rule ``accepts``, smallest first."""
    n = start
    while n <= limit:
        if (
            round_up(n) == n
            and resident(rule, method, n) == n
            and kernel_takes(method, n)
            and (rule.accepts is None or rule.accepts(method, hidden, n))
        ):
            yield n
        n = (n // step + 1) * step
