"""The plugin's behaviour, pinned on vLLM's own classes with no plugin at all:
``python -m upstream.verify_patch`` runs this file on the patched vLLM copy
with ``VLLM_PLUGINS=""`` (it is not collected by ``pytest tests``).

Held to the regression suite's own tables (``upstream.project_helpers``): the
per-rank partition per format, backend and topology, every pad zero before
loading, and FP8 block-aligned and NVFP4 placement rank by rank. The whole
format x backend x topology matrix is dumped here too, for the command to
compare with the plugin's. Last, the plugin's own judgement of this vLLM
where the AMD model is judged: its AMD fix is already in vLLM.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.kimi_k3 import forward_cases as forward
from upstream import partition_matrix as matrix
from upstream import project_helpers as helpers
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.selftest.dequantize import FORMATS as FORWARD_FORMATS
from vllm_kimi_k3_moe.tools.selftest.harness import deployment_outputs, errors_of

LOGICAL = 3072  # Kimi-K3's moe_intermediate_size
HIDDEN = matrix.SMALL_HIDDEN  # latent width of the small CPU layers
EXPERTS = matrix.SMALL_EXPERTS


@pytest.fixture(scope="module")
def model() -> Any:
    """vLLM's Kimi-K3 NVIDIA model module, after vLLM loaded its plugins."""
    from vllm.plugins import load_general_plugins

    torch.set_num_threads(1)
    load_general_plugins()
    module = importlib.import_module(matrix.KIMI_K3_NVIDIA_MODEL)
    with helpers.moe_kernels_on_their_gpu():
        yield module


def experts(model, fmt, backend, topology, *, small=False) -> torch.nn.Module:
    return matrix.build_experts(model, fmt, backend, topology, small=small)


def test_the_plugin_is_off(model):
    assert matrix.form(model) == "vllm", "run with VLLM_PLUGINS=''"


def test_the_matrix_builds_where_the_plugin_does(model):
    """The format x backend x topology matrix on this vLLM, written where
    ``KIMI_K3_MATRIX_OUT`` says: ``upstream.verify_patch`` compares it, case
    by case and rank by rank, with the plugin's on released vLLM."""
    dump = matrix.dump(list(helpers.MATRIX_FORMATS))
    assert dump["form"] == "vllm"
    assert any("partition" in case for case in dump["cases"].values())
    out = os.environ.get("KIMI_K3_MATRIX_OUT")
    if out:
        Path(out).write_text(json.dumps(dump, indent=1, sort_keys=True))


# Every row of the suite's table, the learned rule's (FP8 per channel) too:
# in tree its method decides, and gives the same.
PARTITIONS = helpers.PARTITIONS


@pytest.mark.parametrize(("fmt", "backend", "partitions"), PARTITIONS)
def test_partition_per_format_and_topology(model, fmt, backend, partitions):
    built = [
        experts(model, fmt, backend, t).intermediate_size_per_partition
        for t in helpers.ALIGNED_TOPOLOGIES
    ]
    assert built == partitions


def test_a_method_with_no_kernel_limit_gets_the_logical_slice(model):
    """FP8 per channel: no block to fill, no padding in its method (the
    plugin learns the same rule from it)."""
    layer = experts(model, helpers.LEARNED_FORMAT, "triton", helpers.Topology(32))
    assert layer.intermediate_size_per_partition == LOGICAL // 32


# (format, backend, TP) where the partition is larger than the logical slice
# (the table lists TP16 second and TP32 fourth). In tree, integer groups
# held whole are not zeroed at allocation: the block-aligned loader writes a
# rank's whole shard, its pad included (scales 0), as the matrix's loaded
# bytes show; the plugin zeroes them earlier, before loading.
WHOLE_GROUPS_LOADED = {"awq", "gptq"}
PADDED = [
    (fmt, backend, tp_size)
    for fmt, backend, partitions in PARTITIONS
    for tp_size, partition in ((16, partitions[1]), (32, partitions[3]))
    if partition > LOGICAL // tp_size and fmt not in WHOLE_GROUPS_LOADED
]


def pads(name: str, param: torch.Tensor, logical: int, partition: int) -> list:
    """The parts of an ``[experts, rows, cols]`` expert tensor past the
    logical slice that hold no checkpoint data: rows of each w13 half, w2
    columns."""
    if name.startswith("w13_"):
        per_row = Fraction(param.shape[1], 2 * partition)
        start, end = math.ceil(logical * per_row), int(partition * per_row)
        return [param[:, start:end], param[:, end + start : 2 * end]]
    per_col = Fraction(param.shape[2], partition)
    start, end = math.ceil(logical * per_col), int(partition * per_col)
    return [param[:, :, start:end]]


@pytest.mark.parametrize(("fmt", "backend", "tp_size"), PADDED)
def test_every_pad_is_zero_before_loading(model, fmt, backend, tp_size):
    """Allocation memory reads as POISON here. FP8 block scales in a pad are
    one, vLLM's unit padding scale (the loader writes it too)."""
    layer = experts(model, fmt, backend, helpers.Topology(tp_size), small=True)
    logical, partition = LOGICAL // tp_size, layer.intermediate_size_per_partition
    checked = 0
    for name, param in layer.named_parameters():
        if not name.startswith(("w13_", "w2_")) or param.dim() != 3:
            continue
        unit = 1.0 if fmt == "fp8-block" and "scale" in name else 0.0
        for pad in pads(name, param.data, logical, partition):
            assert torch.all(pad.float() == unit), f"{fmt} {backend}: {name}"
            checked += pad.numel()
    assert checked


@pytest.mark.parametrize(
    ("fmt", "backend", "tensors", "partition", "held"),
    helpers.PLACEMENTS,
    ids=helpers.PLACEMENT_IDS,
)
@pytest.mark.parametrize("rank_index", [0, 1, 2])
def test_tp32_rank_holds_exactly_its_rows(
    model, fmt, backend, tensors, partition, held, rank_index
):
    rank = (0, 23, 31)[rank_index]
    # the checkpoint's tensors traced as the suite traces them
    indices = helpers.checkpoint_indices(EXPERTS, tensors(HIDDEN, LOGICAL))
    planes = helpers.digit_planes(indices)

    def make():
        tp32 = helpers.Rank(helpers.Topology(32), tp_rank=rank)
        layer = experts(model, fmt, backend, tp32, small=True)
        assert layer.intermediate_size_per_partition == partition
        return layer

    decoded = helpers.load_and_decode(make, planes)
    expected = helpers.expected_placement(decoded, indices, partition, held[rank_index])
    for name in decoded:
        assert torch.equal(decoded[name], expected[name]), name


# The output-level proof (tests/models/kimi_k3/test_forward_equivalence.py),
# with vLLM's own KimiMoE, patched in tree: every rank's routed experts,
# through vLLM's own MoE forward, sum to the unsharded experts.
@pytest.mark.parametrize("fmt", FORWARD_FORMATS)
def test_ranks_sum_to_the_unsharded_experts(model, tmp_path, fmt):
    for tp_size in (16, 32):
        case = forward.small_case(fmt, Topology(tp_size))
        layer = forward.prepare_layer(case, forward.CPU, tmp_path / f"tp{tp_size}")
        output = deployment_outputs(forward.CPU, case, model, layer)
        errors = errors_of(output, layer)
        assert all(
            math.isfinite(e) and e < forward.TOLERANCE for e in errors.values()
        ), (fmt, tp_size, errors)


def test_the_plugin_finds_the_amd_fix_in_this_vllm():
    """Judged as a ROCm or XPU process judges it (with vLLM's AMD Kimi-K3
    model, ``amd/linear.py``, whose ``KimiMoE`` the patch changes too): the
    plugin's AMD model patch is already in this vLLM (the factory gets the
    logical size) and stays off, as does the partition it would choose."""
    from vllm.version import __version__

    amd = helpers.MODEL_PATCHES[helpers.KIMI_K3_AMD_LINEAR]
    judged_with = helpers.judged_with({helpers.KIMI_K3_AMD_LINEAR})
    assert amd in judged_with
    verdicts = helpers.verdict.judge_all(judged_with)
    state = {v.patch: v for v in verdicts}
    assert state[amd].state == helpers.verdict.IN_VLLM, state[amd]
    assert state[amd].detail.endswith("intermediate_size=moe_intermediate_size")
    assert state[helpers.PARTITION_PATCH].state == helpers.verdict.IN_VLLM
    decision = helpers.verdict.decide(
        verdicts, __version__, True, helpers.PARTITION_PATCH
    )
    assert not decision.warning, decision.line
    assert amd not in decision.apply
    assert helpers.PARTITION_PATCH not in decision.apply
    assert "already in vLLM, not applied: linear (" in decision.line
