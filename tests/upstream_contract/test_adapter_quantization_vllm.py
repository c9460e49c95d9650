"""``adapters_quantized`` (what ``check`` and ``plan`` read from the config
files) says what vLLM's own config decides for Kimi-K3's latent adapters:
each config below built into a real ``KimiMoE`` at vLLM's module names,
its ``routed_expert_up_proj`` and ``routed_expert_down_proj`` quantized or
not. A contract with vLLM: at a vLLM bump, a failure here says what changed."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import pytest

from tests.models.kimi_k3.builders import build_kimi_moe_layer, kimi_k3_text_config
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.formats import FORMATS, format_named, recognise
from vllm_kimi_k3_moe.formats.adapters import (
    ADAPTERS,
    adapter_contracts,
    adapters_quantized,
)
from vllm_kimi_k3_moe.formats.layouts import safetensors_dtype
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    linear_kernels_on_their_gpu,
    moe_kernels_on_their_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    rank_vllm_config,
    write_model_dir,
)

# vLLM's name of the first MoE layer in the multimodal model
PREFIX = "language_model.model.layers.1.block_sparse_moe"


def _without_adapters_ignored(config: dict) -> dict:
    """``config`` with nothing in its ignore list naming the adapters."""
    config = copy.deepcopy(config)
    for key in ("ignore", "modules_to_not_convert"):
        if key in config:
            config[key] = [e for e in config[key] if "routed_expert" not in str(e)]
    return config


def _linear_kernel_here(config: dict) -> bool:
    """Whether a CPU can build a linear layer quantized as ``config``'s
    experts are: ``linear_kernels_on_their_gpu`` lets vLLM pick the GPU's
    FP8-block and NVFP4 linear kernels; MXFP4 and INT4 linear layers have
    none here, so their adapters kept quantized cannot be built."""
    algo = config.get("quant_algo")
    groups = config.get("config_groups") or {}
    weights = [group.get("weights") or {} for group in groups.values()]
    return algo == "NVFP4" or any(
        (w.get("type"), w.get("num_bits")) in (("float", 8), ("float", 4))
        and w.get("group_size") != 32
        for w in weights
    )


def _with_adapters_ignored(config: dict) -> dict:
    config = copy.deepcopy(config)
    method = config["quant_method"]
    if method == "compressed-tensors":
        config["ignore"] = [*config.get("ignore", []), r"re:.*routed_expert_.*_proj$"]
    elif method == "modelopt":
        config["ignore"] = [*config.get("ignore", []), "*routed_expert_*"]
    elif method == "gptq":
        config["dynamic"] = {**config.get("dynamic", {}), r"-:.*routed_expert_": {}}
    elif method == "awq":
        config["modules_to_not_convert"] = [
            *(config.get("modules_to_not_convert") or []),
            "routed_expert_",
        ]
    return config


def _cases() -> dict[str, dict]:
    published = {
        f"{fmt.name} published": fmt.published_quantization_config()
        for fmt in FORMATS
        if fmt.published_config is not None
    }
    cases = dict(published)
    for name, config in published.items():
        cases[f"{name}, adapters ignored"] = _with_adapters_ignored(config)
        if config["quant_method"] in ("compressed-tensors", "modelopt"):
            kept = _without_adapters_ignored(config)
            if _linear_kernel_here(kept):
                cases[f"{name}, adapters kept"] = kept
    for name in ("nvfp4", "modelopt-nvfp4", "fp8-block", "w4a16"):
        if QUANTIZATION_CONFIGS.get(name) is not None:
            cases[f"{name} (suite's)"] = QUANTIZATION_CONFIGS[name]
    return cases


CASES = _cases()


# ModelOpt's own file (hf_quant_config.json, no quantization_config in
# config.json): its exclude_modules, with and without the adapters.
EXCLUDED = ["*shared_experts*", "*block_sparse_moe.gate*", "*self_attn*", "lm_head"]
HF_QUANT_CASES = {
    "adapters kept": EXCLUDED,
    "adapters excluded": [*EXCLUDED, "*routed_expert_*"],
}


def _built_moe(kimi_model, config, hf_quant_config=None):
    """A ``KimiMoE`` as vLLM builds it under these config files."""
    with tempfile.TemporaryDirectory() as directory:
        model_dir = write_model_dir(
            KIMI_K3_TEXT_CONFIG, config, Serving(), Path(directory)
        )
        if hf_quant_config is not None:
            (model_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
        vllm_config = rank_vllm_config(model_dir, Topology(8), "marlin")
        with (
            simulated_rank(Topology(8)),
            moe_kernels_on_their_gpu(),
            linear_kernels_on_their_gpu(),
        ):
            moe = build_kimi_moe_layer(
                kimi_model.KimiMoE, kimi_k3_text_config(), vllm_config, "meta", PREFIX
            )
    return moe


def _adapters_built_quantized(kimi_model, config, hf_quant_config=None) -> set[bool]:
    """Whether vLLM builds each adapter of a ``KimiMoE`` quantized."""
    moe = _built_moe(kimi_model, config, hf_quant_config)
    return {
        type(getattr(moe, adapter).quant_method).__name__ != "UnquantizedLinearMethod"
        for adapter in ADAPTERS
    }


QUANTIZED_ADAPTERS = [
    fmt.name
    for fmt in FORMATS
    if adapters_quantized(fmt.published_quantization_config(), None)
]


@pytest.mark.parametrize("name", QUANTIZED_ADAPTERS)
def test_quantized_adapters_load_what_check_holds_them_to(kimi_model, name):
    """Where a published config quantizes the adapters, each parameter vLLM
    builds for them is a tensor ``check`` holds to a contract of the same
    shape and dtype (a scalar scale is stored ``[]`` and loaded into a
    ``[1]``)."""
    config = format_named(name).published_quantization_config()
    tensors = recognise(config, None, name).tensors
    moe = _built_moe(kimi_model, config)
    hidden = KIMI_K3_TEXT_CONFIG["hidden_size"]
    routed = KIMI_K3_TEXT_CONFIG["routed_expert_hidden_size"]
    for adapter in ADAPTERS:
        contracts = adapter_contracts(tensors, adapter, hidden, routed)
        parameters = dict(getattr(moe, adapter).named_parameters())
        assert parameters.keys() == contracts.keys(), adapter
        for suffix, parameter in parameters.items():
            contract = contracts[suffix]
            shape = tuple(parameter.shape)
            assert shape == contract.shape or (
                parameter.numel() == 1 and contract.shape == ()
            ), (adapter, suffix, shape, contract.shape)
            assert safetensors_dtype(str(parameter.dtype)) in contract.dtypes


@pytest.mark.parametrize("case", CASES)
def test_adapters_quantized_as_vllm_builds_them(kimi_model, case):
    config = CASES[case]
    built = _adapters_built_quantized(kimi_model, config)
    assert built == {adapters_quantized(config, None)}, built


@pytest.mark.parametrize("case", HF_QUANT_CASES)
def test_modelopts_own_file_as_vllm_reads_it(kimi_model, case):
    hf_quant_config = {
        "producer": {"name": "modelopt"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,  # vLLM wants the field
            "group_size": 16,
            "exclude_modules": HF_QUANT_CASES[case],
        },
    }
    built = _adapters_built_quantized(kimi_model, None, hf_quant_config)
    assert built == {adapters_quantized(None, hf_quant_config)}, built
