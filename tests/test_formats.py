"""The format registry: every record complete, recognised from its own
published config, and known to every place the tests build formats from (a
half-added format fails here first)."""

from __future__ import annotations

import pytest

from tests.models.kimi_k3.format_checkpoints import FORMAT_TENSORS
from tests.models.kimi_k3.kimi_k3_formats import PUBLISHED_FORMATS
from vllm_kimi_k3_moe.formats import (
    FORMAT_NAMES,
    FORMATS,
    FormatError,
    format_named,
    recognise,
)
from vllm_kimi_k3_moe.formats.record import PartitionRule

INTERMEDIATE = 3072  # Kimi-K3's moe_intermediate_size


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
def test_every_record_is_complete(fmt) -> None:
    assert format_named(fmt.name) is fmt
    assert fmt.title and fmt.loads_as and fmt.vllm_methods
    assert isinstance(fmt.partition_rule, PartitionRule)
    assert fmt.moe_backends and "auto" not in fmt.moe_backends
    for unpacked, parameter in fmt.parameter_suffixes.items():
        assert unpacked != parameter


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
def test_each_published_config_is_recognised_as_its_format(fmt) -> None:
    recognised = recognise(fmt.published_quantization_config(), None, "config.json")
    assert recognised.format is fmt
    assert recognised.tensors.sharded  # something to load per projection
    assert INTERMEDIATE % recognised.row_group == 0 and recognised.row_group_unit


def test_names_are_unique_and_every_test_table_knows_each_format() -> None:
    assert len(set(FORMAT_NAMES)) == len(FORMAT_NAMES)
    assert set(PUBLISHED_FORMATS) == set(FORMAT_NAMES)
    # the header-set generator writes every format but the two MXFP4 ones,
    # which kimi_k3_checkpoint writes as the release
    assert set(FORMAT_TENSORS) | {"mxfp4", "ct-mxfp4"} == set(FORMAT_NAMES)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(FormatError) as raised:
        format_named("fp4")
    assert all(name in str(raised.value) for name in FORMAT_NAMES)


# Rows [start, end) of each expert per TP rank, written out (README: "at
# TP32 ranks 0-23 hold 128 rows each and ranks 24-31 none; at TP16 ranks
# 0-11 hold 256 each and ranks 12-15 none"); test_format_checkpoints_end_to_end
# holds the records to what vLLM loads.
FP8_BLOCK_ROWS = {
    8: [(0, 384), (384, 768), (768, 1152), (1152, 1536), (1536, 1920),
        (1920, 2304), (2304, 2688), (2688, 3072)],  # 384 = 3 whole blocks
    16: [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1280),
         (1280, 1536), (1536, 1792), (1792, 2048), (2048, 2304), (2304, 2560),
         (2560, 2816), (2816, 3072)] + [(3072, 3072)] * 4,
    24: [(128 * r, 128 * r + 128) for r in range(24)],  # 128: one block each
    32: [(128 * r, 128 * r + 128) for r in range(24)] + [(3072, 3072)] * 8,
}  # fmt: skip


@pytest.mark.parametrize("tp_size", FP8_BLOCK_ROWS)
def test_fp8_block_ranks_load_whole_blocks(tp_size) -> None:
    fp8 = recognise(format_named("fp8-block").published_quantization_config(), None, "")
    assert fp8.rank_rows(INTERMEDIATE, tp_size) == FP8_BLOCK_ROWS[tp_size]


# Groups of 128 (AWQ, GPTQ) split as FP8's blocks do.
WHOLE_GROUPS_AT_TP32 = {"fp8-block", "awq", "gptq"}


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int_groups_of_128_load_whole_groups_as_fp8_blocks(fmt) -> None:
    recognised = recognise(format_named(fmt).published_quantization_config(), None, "")
    assert recognised.rank_rows(INTERMEDIATE, 32) == FP8_BLOCK_ROWS[32]
    # experts split through data parallelism: TP8 x DP4 is 32 GPUs too
    assert recognised.rank_rows(INTERMEDIATE, 8 * 4) == FP8_BLOCK_ROWS[32]


@pytest.mark.parametrize(
    "fmt",
    [f for f in FORMATS if f.name not in WHOLE_GROUPS_AT_TP32],
    ids=lambda f: f.name,
)
def test_other_formats_load_even_slices(fmt) -> None:
    recognised = recognise(fmt.published_quantization_config(), None, "")
    assert recognised.rank_rows(INTERMEDIATE, 32)[:3] == [
        (0, 96),
        (96, 192),
        (192, 288),
    ]
    assert recognised.rank_rows(INTERMEDIATE, 32)[31] == (2976, 3072)


def test_a_kernel_that_allocates_more_strides_by_its_allocation() -> None:
    """Whole groups at the kernel's partition: MXFP4 over 64 GPUs (48 rows)
    on Marlin, which allocates 128: GPUs 0-23 hold 128 rows, 24-63 none."""
    release = recognise(format_named("mxfp4").published_quantization_config(), None, "")
    assert release.rank_rows(INTERMEDIATE, 64)[:2] == [(0, 64), (64, 128)]
    rows = release.rank_rows(INTERMEDIATE, 64, partition=128)
    assert rows[:24] == [(128 * r, 128 * r + 128) for r in range(24)]
    assert rows[24:] == [(3072, 3072)] * 40
