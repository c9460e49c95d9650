"""Per-GPU weights of the whole Kimi-K3 language model, from vLLM's real model.

For a deployment, vLLM 0.33.0's ``KimiLinearForCausalLM`` (the language model
``KimiK3ForConditionalGeneration`` builds, without the vision tower) is built
for rank 0 on the ``meta`` device twice, with vLLM's own ``KimiMoE`` and with
this plugin's, and every parameter's size is read and put into one component
by its name. The model is vLLM's own code throughout; ``simulated_rank`` and
``cpu_stand_ins`` stand in only for what a CPU lacks (parallel groups, CUDA
streams and events, MLA attention kernels), none of which holds parameters.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.deployment import Deployment, validate
from vllm_kimi_k3_moe.kimi_k3_text_config import (
    KIMI_K3_ATTENTION_CONFIG,
    KIMI_K3_MOE_TEXT_CONFIG,
    moe_layer_count,
)

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
KIMI_K3_WHOLE_TEXT_CONFIG: dict[str, Any] = {
    **KIMI_K3_MOE_TEXT_CONFIG,
    **KIMI_K3_ATTENTION_CONFIG,
}
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


@dataclass(frozen=True)
class WholeModelSize:
    """Per-GPU parameter bytes of the whole language model, upstream vLLM and
    with the plugin."""

    deployment: Deployment
    moe_layers: int
    upstream: ModelAllocation
    fixed: ModelAllocation


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
    from vllm_kimi_k3_moe.simulated_rank import replaced_attributes

    with replaced_attributes(model_module, KimiMoE=kimi_moe_cls):
        yield


def architecture_config(text_config: dict[str, Any], directory: Path) -> Any:
    """vLLM's ``ModelConfig`` of a weightless ``config.json`` for the Kimi-K3
    language model (``kimi_linear``, bfloat16), written to ``directory``."""
    from vllm.config import ModelConfig

    document = {
        **text_config,
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(document))
    return ModelConfig(model=str(directory), skip_tokenizer_init=True)


def build_language_model(
    kimi_moe_cls: type, architecture: Any, deployment: Deployment
) -> Any:
    """vLLM's ``KimiLinearForCausalLM`` for rank 0 of ``deployment`` on the
    ``meta`` device, its MoE layers built from ``kimi_moe_cls``."""
    import importlib

    import torch
    from vllm.config import set_current_vllm_config

    import vllm_kimi_k3_moe
    from vllm_kimi_k3_moe.cpu_stand_ins import whole_model_on_cpu
    from vllm_kimi_k3_moe.simulated_rank import rank_vllm_config, rank_zero_of

    model_module = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    with (
        rank_zero_of(deployment) as topology,
        whole_model_on_cpu(),
        kimi_moe_class(model_module, kimi_moe_cls),
    ):
        vllm_config = rank_vllm_config(
            topology, deployment.quantization, architecture=architecture
        )
        with set_current_vllm_config(vllm_config), torch.device("meta"):
            return model_module.KimiLinearForCausalLM(
                vllm_config=vllm_config, prefix=""
            )


def whole_model_bytes(
    text_config: dict[str, Any], deployment: Deployment
) -> WholeModelSize:
    """Size the whole language model of ``deployment``'s rank 0, upstream and
    fixed. ``text_config`` is a full Kimi-K3 text config (MoE, attention and
    embedding fields, e.g. ``KIMI_K3_WHOLE_TEXT_CONFIG``)."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    from vllm_kimi_k3_moe.plan import kimi_moe_classes

    validate(text_config, deployment)
    upstream_cls, fixed_cls = kimi_moe_classes()
    kda_layer = KimiLinearConfig(**text_config).is_kda_layer
    with tempfile.TemporaryDirectory(prefix="kimi-k3-config-") as directory:
        architecture = architecture_config(text_config, Path(directory))
        upstream, fixed = (
            allocation_of(
                build_language_model(cls, architecture, deployment), kda_layer
            )
            for cls in (upstream_cls, fixed_cls)
        )
    return WholeModelSize(
        deployment=deployment,
        moe_layers=moe_layer_count(text_config),
        upstream=upstream,
        fixed=fixed,
    )
