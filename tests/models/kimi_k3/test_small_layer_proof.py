"""On vLLM code the plugin was not verified against, the first Kimi-K3 layer
built proves the fixes on a small copy of itself before any layer gets them
(``vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof.small_layer``);
where that does not hold, the plugin steps aside whole and the layer is vLLM alone's.

Unverified code, here: the installed vLLM with its recorded digests changed,
so that every fix is judged by signatures and checks (``checked``), as on a
nightly whose targets' bodies changed. The nightlies themselves (a copy of
vLLM with its code changed) are in ``tests/drift``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import vllm_kimi_k3_moe
from tests.fixes_on import fixes_on
from tests.models.kimi_k3.test_never_worse_than_vllm_alone import PARTITIONS
from upstream import partition_matrix as matrix
from upstream import project_helpers as helpers
from vllm_kimi_k3_moe import import_hooks
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof import first_layer
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof.small_layer import (
    NotProven,
    Placed,
    covered_once,
    placed,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading import (
    expert_loading,
)
from vllm_kimi_k3_moe.patching import is_plugin_wrapper, upstream_class
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

# The regression suite's partition per format, backend and topology
# (its ALIGNED_TOPOLOGIES: TP8, TP16, TP24, TP32, TP16 x DP2, TP32 EP).
COLUMN = {
    Topology(16): 1,
    Topology(32): 3,
    Topology(16, dp_size=2): 4,
    Topology(32, expert_parallel=True): 5,
}
RIGHT = {
    (fmt, backend, topology): partitions[column]
    for fmt, backend, partitions in PARTITIONS
    for topology, column in COLUMN.items()
}
TP32 = Topology(32)
PROVEN = [
    ("fp8-block", "triton", TP32),  # whole 128-row blocks, the last GPUs none
    ("fp8-block", "triton", Topology(16)),
    ("mxfp4", "marlin", TP32),
    ("mxfp4", "marlin", Topology(16, dp_size=2)),  # the split over TP x DP
    ("mxfp4", "marlin", Topology(32, expert_parallel=True)),  # whole experts
    ("nvfp4", "cutlass", TP32),  # torch.empty: the plugin's zero pads
    ("w4a16", "marlin", TP32),
    ("awq", "marlin", TP32),  # transposed, whole groups
    ("bf16", "triton", TP32),
]


def build(model: Any, fmt: str, backend: str, topology: Topology) -> Any:
    with helpers.moe_kernels_on_their_gpu():
        return matrix.build_experts(model, fmt, backend, topology, small=True)


def plugin_lines(caplog: Any) -> list[logging.LogRecord]:
    """The plugin's records but the per-method partition lines."""
    return [
        r
        for r in caplog.records
        if r.name == vllm_kimi_k3_moe.logger.name
        and not r.getMessage().startswith("vllm-kimi-k3-moe: Kimi-K3 routed experts")
    ]


@pytest.mark.parametrize(("fmt", "backend", "topology"), PROVEN, ids=str)
def test_the_first_layer_proves_the_fixes(
    kimi_model, unverified_code, fmt, backend, topology
):
    experts = build(kimi_model, fmt, backend, topology)

    (record,) = plugin_lines(unverified_code)
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "verified on this vLLM" in message
    method = type(experts.quant_method).__name__
    assert f"proven on a small layer of this deployment ({method}, " in message
    split = topology.moe_group if not topology.expert_parallel else 1
    assert f"{split} GPU{'s' * (split > 1)} x 2 experts" in message
    assert not first_layer.owed()
    # every fix judged in this process (the AMD model's where it was imported)
    judged = vllm_kimi_k3_moe.patches_judged_with(vllm_kimi_k3_moe._judged_models)
    assert set(vllm_kimi_k3_moe._decided[0]) == set(fixes_on(judged))
    assert experts.intermediate_size_per_partition == RIGHT[fmt, backend, topology]
    assert expert_loading(experts) is not None  # strict loading on


def _loader_without_whole_groups(monkeypatch: Any) -> None:
    """A nightly whose expert loader no longer reads ``tp_shard_with_padding``
    (each GPU loads its even slice, whole-group layouts or not): code no
    check on the plugin's targets sees."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    own = RoutedExperts._load_model_weight_or_group_weight_scale

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        flag = self.moe_config.tp_shard_with_padding
        self.moe_config.tp_shard_with_padding = False
        try:
            return own(self, *args, **kwargs)
        finally:
            self.moe_config.tp_shard_with_padding = flag

    monkeypatch.setattr(RoutedExperts, "_load_model_weight_or_group_weight_scale", load)


def _layout(experts: Any) -> tuple[Any, ...]:
    config = experts.moe_config
    parameters = sorted(
        (name, tuple(p.shape), p.dtype) for name, p in experts.named_parameters()
    )
    return (
        type(experts.quant_method),
        config.intermediate_size_per_partition,
        config.intermediate_size_per_partition_unpadded,
        config.tp_shard_with_padding,
        parameters,
    )


def test_where_the_proof_fails_the_plugin_steps_aside_whole(
    kimi_model, unverified_code, monkeypatch
):
    from vllm.model_executor.layers.fused_moe import routed_experts

    _loader_without_whole_groups(monkeypatch)
    experts = build(kimi_model, "fp8-block", "triton", TP32)

    (record,) = plugin_lines(unverified_code)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "nothing patched" in message and "did not hold" in message
    assert "loaded by no GPU" in message and "\n" not in message
    # nothing of the plugin's is left on, nor will go on
    assert vllm_kimi_k3_moe._decided[0] == ()
    assert kimi_model.KimiMoE is upstream_class(kimi_model.KimiMoE)
    get_quant_method = routed_experts.RoutedExperts._get_quant_method
    assert not is_plugin_wrapper(get_quant_method)
    patched = {module for module, _ in vllm_kimi_k3_moe.PATCHES}
    # only the registration's hooks on the model modules are left
    assert not (import_hooks.watched_modules() & patched) - set(
        vllm_kimi_k3_moe.MODEL_PATCHES
    )
    # the layer being built when the proof failed is vLLM alone's
    assert expert_loading(experts) is None
    assert experts.intermediate_size_per_partition == 256
    assert experts.moe_config.intermediate_size_per_partition_unpadded == 96
    vllm_kimi_k3_moe.unregister()
    assert _layout(experts) == _layout(build(kimi_model, "fp8-block", "triton", TP32))


def _rows(*values: int) -> torch.Tensor:
    return torch.tensor([[v, v + 1] for v in values], dtype=torch.uint8)


def test_a_gpu_s_rows_are_found_and_what_is_past_them_checked():
    checkpoint = _rows(10, 20, 30, 40)
    param = torch.zeros(3, 2, dtype=torch.uint8)
    param[:2] = checkpoint[1:3]
    assert placed(param, checkpoint, False, "w") == Placed(1, 2)

    param[2] = torch.tensor([7, 9])  # memory nobody wrote
    with pytest.raises(NotProven, match="what the memory held"):
        placed(param, checkpoint, False, "w")
    param[2] = 1  # a scale's pad vLLM's loader writes as 1: not memory
    assert placed(param, checkpoint, True, "s") == Placed(1, 2)
    with pytest.raises(NotProven):
        placed(param, checkpoint, False, "w")  # but a weight's pad is zero


def test_every_checkpoint_row_once_over_the_gpus():
    covered_once([Placed(0, 2), Placed(2, 2), Placed(0, 0)], 4, "w")
    with pytest.raises(NotProven, match="row 1 loaded twice"):
        covered_once([Placed(0, 2), Placed(1, 3)], 4, "w")
    with pytest.raises(NotProven, match="row 2 loaded by no GPU"):
        covered_once([Placed(0, 2), Placed(3, 1)], 4, "w")
    with pytest.raises(NotProven, match="row 3 loaded by no GPU"):
        covered_once([Placed(0, 3)], 4, "w")
