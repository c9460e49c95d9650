"""Every MoE quantization method the installed vLLM defines is accounted for: a
format of the registry names it, or the suite builds it from a config and the
plugin learns its partition rule from it (``learned_rule``), or it quantizes
while loading (online: a rule learned from what it quantizes to, tested in
``preparation/test_online_quantization.py``), or it is not a method
Kimi-K3's NVIDIA experts can get, for the reason given. A method vLLM adds
fails here until it is one of the four."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from tests.models.kimi_k3.preparation.online import PATHS
from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import rule_of
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank

KNOWN = {name for fmt in FORMATS for name in fmt.vllm_methods}
# method -> (config in the suite's quantization space, --moe-backend, layout)
LEARNED = {
    "Fp8MoEMethod": ("fp8-native-block", "triton", Topology(32)),
    "ModelOptFp8MoEMethod": ("modelopt-fp8", "triton", Topology(32)),
    "ModelOptMxFp8FusedMoE": ("modelopt-mxfp8", "marlin", Topology(32)),
    "CompressedTensorsW8A8Mxfp8MoEMethod": ("ct-mxfp8", "marlin", Topology(32)),
    # AutoAWQ's fallback where Marlin refuses the partition
    "MoeWNA16Method": ("awq", "humming", Topology(8, dp_size=4)),
}
# methods with no build for Kimi-K3's routed experts on NVIDIA in vLLM 0.33.0
NOT_KIMI_K3_ON_NVIDIA = {
    "FusedMoEModularMethod": "a wrapper of another method (LoRA, elastic EP)",
    "CompressedTensorsMoEMethod": "compressed-tensors' dispatcher, never built",
    "QuarkMoEMethod": "Quark's dispatcher, never built",
    "OnlineMoEMethodBase": "the online methods' base, never built",
    "_Fp8OnlineMoEBase": "the online FP8 methods' base, never built",
    "GptOssMxfp4MoEMethod": "gpt-oss's MXFP4 (its kernels refuse SiTU)",
    "ModelOptBlockQuantMoEMethod": "SiLU/ReLU2 on b12x only (modelopt_block_quant)",
    "CompressedTensorsW4A8Int8MoEMethod": "CPU platforms only",
    "CompressedTensorsW4A16FlydslMoEMethod": "ROCm gfx950 only",
    "Fp8BlockExpertsAsMxfp4FusedMoE": "ROCm only (VLLM_FP8_MOE_REQUANT=mxfp4)",
}
# Methods an online --quantization flag gives Kimi-K3's experts: built,
# loaded, quantized and prepared at every layout by
# preparation/test_online_quantization.py (its PATHS), with the rule learned
# from what each quantizes to.
ONLINE = {path.method for path in PATHS}
# Methods Kimi-K3 can get from another toolkit's checkpoint, which the
# suite's quantization space does not build: the chooser learns their rule
# when vLLM builds them, untested here.
NOT_BUILT_BY_THE_SUITE = {
    "CompressedTensorsW8A8Int8MoEMethod",
    "CompressedTensorsW4A8Fp8MoEMethod",
    "HummingMoEMethod",
    "QuarkNvfp4MoEMethod",
    "QuarkOCP_MX_MoEMethod",
    "QuarkW4A16Int4MoEMethod",
    "QuarkW4A8Fp8MoEMethod",
    "QuarkW8A8Fp8MoEMethod",
    "QuarkW8A8Int8MoEMethod",
    "QuarkW8A8Mxfp8MoEMethod",
    "INCMxfp4MoEMethod",
    "INCMxfp8MoEMethod",
    "INCARKWNA16MoEMethod",
}
# the vLLM series that added a method listed above (the rest: 0.33 or before)
ADDED_IN = {
    "Fp8BlockExpertsAsMxfp4FusedMoE": (0, 34),
    "LutBOnlineMoEMethod": (0, 34),
}
PACKAGES = ("vllm.model_executor.layers.quantization", "vllm.model_executor.layers")


def moe_methods() -> set[type]:
    """Every subclass of vLLM's ``FusedMoEMethodBase`` its quantization and
    layer packages define (modules that need a GPU library to import are
    skipped: their methods are in ``NOT_KIMI_K3_ON_NVIDIA`` by name)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
        FusedMoEMethodBase,
    )

    for package in PACKAGES:
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, package + "."):
            try:
                importlib.import_module(module.name)
            except Exception:  # ROCm, DeepEP, ...: not on this box
                continue
    found, stack = set(), [FusedMoEMethodBase]
    while stack:
        for subclass in stack.pop().__subclasses__():
            if subclass not in found:
                found.add(subclass)
                stack.append(subclass)
    return found


def known(cls: type) -> bool:
    return any(base.__name__ in KNOWN for base in cls.__mro__)


def test_every_vllm_moe_method_is_accounted_for(kimi_model):
    from vllm.version import __version_tuple__

    methods = {cls.__name__ for cls in moe_methods() if not known(cls)}
    listed = set(LEARNED) | set(NOT_KIMI_K3_ON_NVIDIA) | NOT_BUILT_BY_THE_SUITE | ONLINE
    assert methods - listed == set(), "methods with neither a known nor a learned rule"
    here = {n for n in listed if ADDED_IN.get(n, (0, 33)) <= __version_tuple__[:2]}
    importable = here - set(NOT_KIMI_K3_ON_NVIDIA)  # those may not import here
    assert not importable - methods, "stale names"


@pytest.mark.parametrize("name", sorted(LEARNED))
def test_the_plugin_learns_a_rule_for_each(format_experts, name):
    config, backend, topology = LEARNED[name]
    experts = format_experts(config, backend, topology)
    method = experts.quant_method
    assert type(method).__name__ == name
    with simulated_rank(topology):  # the rule runs the method's create_weights
        rule = rule_of(method, experts.moe_config)
    assert rule is not None and "learned" in rule.name
    assert "learned" in experts.kimi_k3_partition.reason
