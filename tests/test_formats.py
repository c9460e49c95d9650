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
    assert INTERMEDIATE % fmt.alignment == 0 and fmt.alignment_unit
    for unpacked, parameter in fmt.parameter_suffixes.items():
        assert unpacked != parameter


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
def test_each_published_config_is_recognised_as_its_format(fmt) -> None:
    recognised = recognise(fmt.published_quantization_config(), None, "config.json")
    assert recognised.format is fmt
    assert recognised.tensors.sharded  # something to load per projection


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
