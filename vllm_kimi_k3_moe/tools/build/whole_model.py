"""Per-GPU weights of the whole Kimi-K3 language model, from vLLM's real model.

For a deployment, vLLM 0.33.0's ``KimiLinearForCausalLM`` (the language model
``KimiK3ForConditionalGeneration`` builds, without the vision tower) is built
for rank 0 on the ``meta`` device twice, with vLLM's own ``KimiMoE`` and with
this plugin's, under the ``VllmConfig`` ``vllm serve`` makes for it (the
format's published quantization config, MoE backend, KV-cache dtype, context
length), and every parameter's size is read and put into one component by
its name. The model is vLLM's own code throughout; ``simulated_rank`` and
``cpu_stand_ins`` stand in only for what a CPU lacks (parallel groups, CUDA
streams and events, attention, MoE and linear kernels), none of which holds
parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.tools.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.text_config import main_moe_layers
from vllm_kimi_k3_moe.tools.plan.planner import LayerAllocation

COMPONENTS = (
    "embeddings",
    "lm_head",
    "mla_attention",
    "kda_attention",
    "dense_mlp",
    "moe_routed_experts",
    "moe_other",  # shared experts, latent projections, router
    "norms_other",  # layer norms, attention-residual norms and projections
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.")
_ROUTED = re.compile(r"\.block_sparse_moe\.experts\.routed_experts\.(w13|w2)_")


@dataclass(frozen=True)
class ModelAllocation:
    """What the language model allocates on one GPU, by component (bytes of
    parameters)."""

    components: dict[str, int]
    parameters: int  # count of parameter tensors

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())


def component_of(name: str, kda_layer: Callable[[int], bool]) -> str:
    """The component a parameter of ``KimiLinearForCausalLM`` belongs to, by
    its name; ``kda_layer(i)`` says whether 0-based layer ``i`` is KDA."""
    if name.startswith("model.embed_tokens."):
        return "embeddings"
    if name.startswith("lm_head."):
        return "lm_head"
    layer = _LAYER.match(name)
    if layer is None:
        return "norms_other"
    index, part = int(layer.group(1)), layer.group(2)
    if part == "self_attn":
        return "kda_attention" if kda_layer(index) else "mla_attention"
    if part == "mlp":
        return "dense_mlp"
    return "moe_routed_experts" if _ROUTED.search(name) else "moe_other"


def allocation_of(model: Any, kda_layer: Callable[[int], bool]) -> ModelAllocation:
    """Sum the bytes of every parameter of ``model`` by component."""
    components = dict.fromkeys(COMPONENTS, 0)
    count = 0
    for name, parameter in model.named_parameters():
        components[component_of(name, kda_layer)] += (
            parameter.numel() * parameter.element_size()
        )
        count += 1
    return ModelAllocation(components=components, parameters=count)


@contextmanager
def kimi_moe_class(model_module: Any, kimi_moe_cls: type) -> Iterator[None]:
    """Make ``KimiDecoderLayer`` build ``kimi_moe_cls``: it looks ``KimiMoE``
    up as a global of vLLM's model module when it builds. Restored on exit."""
    from vllm_kimi_k3_moe.tools.build.rank import replaced_attributes

    with replaced_attributes(model_module, KimiMoE=kimi_moe_cls):
        yield


def write_architecture(
    text_config: dict[str, Any],
    deployment: Deployment,
    serving: Serving,
    directory: Path,
) -> Path:
    """Write a weightless ``config.json`` for the Kimi-K3 language model
    (``kimi_linear``, bfloat16) with the quantization config of
    ``deployment``'s published format to ``directory``, and return the
    directory: vLLM resolves the format from it as from a checkpoint's."""
    from vllm_kimi_k3_moe.formats.published_configs import quantization_config

    document = {
        **text_config,
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "torch_dtype": "bfloat16",
        # vLLM refuses a max_model_len above it; it sizes only the RoPE table
        "max_position_embeddings": max(
            serving.max_model_len, text_config.get("max_position_embeddings", 0)
        ),
    }
    quantization = quantization_config(deployment.quantization)
    if quantization is not None:
        document["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(document))
    return directory


def server_vllm_config(
    architecture: Path, deployment: Deployment, serving: Serving
) -> Any:
    """A fresh ``VllmConfig`` (and ``ModelConfig``: vLLM's model hooks run
    once per one) for rank 0 of ``deployment`` as ``vllm serve`` makes it on
    an NVIDIA GPU: the model and format in the ``architecture`` directory,
    its MoE backend, KV-cache dtype, context length and prefix caching
    (vLLM's default). Where this CPU box's platform turned off what CUDA
    keeps on (the hybrid KV-cache manager), CUDA's setting is put back."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KernelConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    from vllm_kimi_k3_moe.tools.build.rank import moe_backend_setting

    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(architecture),
            skip_tokenizer_init=True,
            max_model_len=serving.max_model_len,
        ),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=deployment.tp_size,
            data_parallel_size=deployment.dp_size,
            enable_expert_parallel=deployment.expert_parallel,
        ),
        kernel_config=KernelConfig(moe_backend=moe_backend_setting(deployment)),
        scheduler_config=SchedulerConfig(
            max_model_len=serving.max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(
            cache_dtype=serving.kv_cache_dtype, enable_prefix_caching=True
        ),
    )
    # CudaPlatform supports the hybrid KV-cache manager (MLA + KDA groups);
    # the CPU box's platform does not, so VllmConfig turned it off.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vllm_config


@dataclass(frozen=True)
class RankBuild:
    """One build of the language model for rank 0 (on ``meta``): what it
    allocates, what its first MoE layer allocates, and the ``VllmConfig`` it
    was built under (which holds its attention layers, for the KV-cache
    specs)."""

    model: Any
    allocation: ModelAllocation
    moe_layer: LayerAllocation
    vllm_config: Any


def build_rank(
    kimi_moe_cls: type,
    text_config: dict[str, Any],
    deployment: Deployment,
    serving: Serving,
    architecture: Path,
) -> RankBuild:
    """vLLM's ``KimiLinearForCausalLM`` for rank 0 of ``deployment`` on the
    ``meta`` device, its MoE layers built from ``kimi_moe_cls``, sized."""
    import importlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    import vllm_kimi_k3_moe
    from vllm_kimi_k3_moe.tools.build.stand_ins import whole_model_on_cpu
    from vllm_kimi_k3_moe.tools.build.rank import rank_zero_of

    model_module = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    with (
        rank_zero_of(deployment),
        whole_model_on_cpu(),
        kimi_moe_class(model_module, kimi_moe_cls),
    ):
        vllm_config = server_vllm_config(architecture, deployment, serving)
        with set_current_vllm_config(vllm_config), torch.device("meta"):
            model = model_module.KimiLinearForCausalLM(
                vllm_config=vllm_config, prefix=""
            )
    first_moe = main_moe_layers(text_config)[0]
    return RankBuild(
        model=model,
        allocation=allocation_of(model, KimiLinearConfig(**text_config).is_kda_layer),
        moe_layer=LayerAllocation.of(model.model.layers[first_moe].block_sparse_moe),
        vllm_config=vllm_config,
    )
