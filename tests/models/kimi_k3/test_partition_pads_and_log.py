"""Every pad the plugin allocates is zero before loading, in every format; a
method without a rule (none learned either) keeps vLLM alone's partition,
zeroed; each process says
in one log line per method what it allocated."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from tests.models.kimi_k3.kimi_k3_formats import LEARNED_FORMAT, PUBLISHED_FORMATS
from tests.models.kimi_k3.test_never_worse_than_vllm_alone import PARTITIONS
from vllm_kimi_k3_moe.model_executor.layers.fused_moe import kernel_rows, said_once
from vllm_kimi_k3_moe.tools.deployment.topology import Topology


@pytest.fixture
def build_small(format_experts):
    """Rank ``topology``'s routed experts on CPU tensors at the small shapes
    (real 3072 intermediate)."""

    def build(*args, **kwargs) -> nn.Module:
        return format_experts(*args, small=True, device="cpu", **kwargs)

    return build


def expert_tensors(experts: nn.Module) -> dict[str, object]:
    """Per-expert weights and scales: ``[experts, rows, cols]`` w13/w2."""
    return {
        name: param
        for name, param in experts.named_parameters()
        if name.startswith(("w13_", "w2_")) and param.dim() == 3
    }


# (format, backend, topology) where the plugin allocates more than the
# logical slice (PARTITIONS lists TP16 second and TP32 fourth), and where a
# GPU of an expert split through data parallelism holds whole groups.
PADDED = [
    (fmt, backend, Topology(tp_size))
    for fmt, backend, partitions in PARTITIONS
    for tp_size, partition in ((16, partitions[1]), (32, partitions[3]))
    if partition > 3072 // tp_size
] + [
    (fmt, backend, Topology(8, dp_size=4))
    for fmt, backend in [
        ("fp8-block", "triton"),
        ("ct-int4-g128-asym", "marlin"),
        ("ct-int8-g64-sym", "marlin"),
        ("awq-int4-g64", "marlin"),
    ]
]


@pytest.mark.parametrize(
    ("fmt", "backend", "topology"),
    PADDED,
    ids=lambda v: v.label() if isinstance(v, Topology) else str(v),
)
def test_every_pad_is_zero_before_loading(
    build_small, uninitialised_memory_is_visible, fmt, backend, topology
):
    experts = build_small(fmt, backend, topology)
    assert experts.intermediate_size_per_partition > 3072 // topology.moe_group
    tensors = expert_tensors(experts)
    assert tensors, "no expert tensors found"
    for name, tensor in tensors.items():
        assert not tensor.any(), f"{fmt} on {backend}: {name} holds non-zero pad"


@pytest.mark.parametrize("fmt", ["fp8-block", "w4a16", LEARNED_FORMAT])
def test_vllm_alone_leaves_its_pad_uninitialised(
    build_small, uninitialised_memory_is_visible, fmt
):
    """What the zero-fill fixes: vLLM alone's model-level block never reaches
    the latent-MoE experts, so its 256-row pad is whatever memory held."""
    experts = build_small(
        fmt, "triton" if "fp8" in fmt else "marlin", Topology(32), upstream=True
    )
    assert experts.intermediate_size_per_partition == 256
    w13 = expert_tensors(experts)["w13_weight" if "fp8" in fmt else "w13_weight_packed"]
    assert w13[:, 96:256].any()


def test_method_without_rule_keeps_vllm_alone_partition_zeroed(
    build_small, uninitialised_memory_is_visible, monkeypatch
):
    """Where no rule can be had (a method whose ``create_weights`` needs
    more of a real layer than ``learned_rule`` gives it: the rule is None),
    vLLM alone's partition, every pad zero."""
    monkeypatch.setattr(kernel_rows, "learned_rule", lambda method, config: None)
    mine = build_small(LEARNED_FORMAT, "triton", Topology(32))
    theirs = build_small(LEARNED_FORMAT, "triton", Topology(32), upstream=True)
    assert type(mine.quant_method).__name__ == "CompressedTensorsW8A8Fp8MoEMethod"
    assert not mine.quant_method.block_quant
    shapes = {n: p.shape for n, p in mine.named_parameters()}
    assert shapes == {n: p.shape for n, p in theirs.named_parameters()}
    assert mine.intermediate_size_per_partition == 256
    assert not any(t.any() for t in expert_tensors(mine).values())


@pytest.fixture
def plugin_log(caplog, monkeypatch):
    """The plugin's INFO lines, each process starting with none logged."""
    monkeypatch.setattr(said_once, "_said", set())
    monkeypatch.setattr(said_once.logger, "handlers", [caplog.handler])
    monkeypatch.setattr(said_once.logger, "propagate", False)
    caplog.set_level(logging.INFO, logger=said_once.logger.name)
    return caplog


@pytest.mark.parametrize(
    ("fmt", "backend", "expected", "topology"),
    [
        (  # the README's example
            "mxfp4",
            "marlin",
            "Kimi-K3 routed experts on Mxfp4MoEMethod (marlin): 128 intermediate "
            "rows per GPU (logical 96, vLLM alone 256); smallest partition "
            "accepted (the method's own maybe_roundup_sizes)",
            Topology(32),
        ),
        (
            "fp8-block",
            "triton",
            "Kimi-K3 routed experts on CompressedTensorsW8A8Fp8MoEMethod (triton): "
            "128 intermediate rows per GPU (logical 96, vLLM alone 256); smallest "
            "partition accepted (pad_tp_shard_to_weight_blocks); whole 128-row "
            "groups per GPU, this GPU rows 0-127",
            Topology(32),
        ),
        (
            LEARNED_FORMAT,
            "triton",
            "Kimi-K3 routed experts on CompressedTensorsW8A8Fp8MoEMethod (triton): "
            "96 intermediate rows per GPU (logical 96, vLLM alone 256); smallest "
            "partition accepted (learned from CompressedTensorsW8A8Fp8MoEMethod."
            "create_weights: 1 rows per scale group)",
            Topology(32),
        ),
        (  # a kernel that pads vLLM alone's partition again when it prepares
            "w4a16",
            "marlin",
            "Kimi-K3 routed experts on CompressedTensorsWNA16MoEMethod (marlin): "
            "128 intermediate rows per GPU (logical 96, vLLM alone 96, 128 once "
            "its kernel pads them); smallest partition accepted (group_size "
            "divisibility and check_moe_marlin_supports_config)",
            Topology(8, dp_size=4),
        ),
    ],
)
def test_one_log_line_per_process_says_what_was_allocated(
    build_small, plugin_log, fmt, backend, expected, topology
):
    for layer in (1, 2, 3):  # every MoE layer of a model allocates alike
        build_small(
            fmt, backend, topology, prefix=f"model.layers.{layer}.block_sparse_moe"
        )
    # the plugin's own records (vLLM's, propagated, may be there too)
    name = said_once.logger.name
    (record,) = [r for r in plugin_log.records if r.name == name]
    assert record.levelno == logging.INFO
    assert record.getMessage() == f"vllm-kimi-k3-moe: {expected}"


@pytest.mark.parametrize("fmt", PUBLISHED_FORMATS)
def test_every_published_format_has_a_rule(build_small, fmt):
    from vllm_kimi_k3_moe.formats import format_of_method

    backend = {"fp8-block": "triton", "bf16": "triton"}.get(fmt, "marlin")
    experts = build_small(fmt, backend, Topology(32))
    assert format_of_method(experts.quant_method).name == fmt
