"""Build vLLM's whole Kimi-K3 model for rank 0 of a deployment.

vLLM 0.33.0's ``KimiK3ForConditionalGeneration`` (what ``vllm serve`` builds:
the vision tower, unless ``--language-model-only``, and the language model
``KimiLinearForCausalLM``) is built for rank 0 on the ``meta`` device, with
vLLM's own ``KimiMoE`` or with this plugin's, under the ``VllmConfig``
``vllm serve`` makes for it (``vllm_config.rank_vllm_config``), and what it
allocates is read from its parameters (``allocation``). The model is vLLM's
own code throughout; ``rank`` and ``stand_ins`` stand in only for what a CPU
lacks (parallel groups, CUDA streams and events, the current device,
attention, MoE and linear kernels), none of which holds parameters.

On an AMD GPU (``plan --gpu mi300x``; ``gpus.an_amd_gpu_named``) the
model is vLLM's AMD one, whole, as ROCm builds it (``vllm/models/kimi_k3/
amd``: its wrapper, ``amd/linear.py``'s language model and ``KimiMoE``,
upstream's or the plugin's, its ROCm KDA layers, ``amd/mtp.py``'s draft),
under ROCm's platform on that GPU's architecture (``stand_ins.amd_gpu``,
``stand_ins.rocm_model``), its MLA layers on the backend vLLM's ROCm
selector picks there (``stand_ins.rocm_attention``). On an Intel GPU (XPU)
the build is still a hybrid: vLLM's NVIDIA model for everything but the
routed MoE, whose layers are vLLM's AMD ``KimiMoE`` (XPU's attention and
KDA kernels are not stood in), and ``plan`` says so.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.compat import dsa_topk_indices_buffer
from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.gpus import XPU, named_amd_arch
from vllm_kimi_k3_moe.tools.deployment.nodes import DEFAULT_GPUS_PER_NODE
from vllm_kimi_k3_moe.tools.deployment.text_config import main_moe_layers
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.allocation import (
    LayerAllocation,
    ModelAllocation,
    PlacedAllocation,
)
from vllm_kimi_k3_moe.tools.meta_rank.draft import build_draft, own_parameters
from vllm_kimi_k3_moe.tools.meta_rank.online_experts import quantized_routed_bytes
from vllm_kimi_k3_moe.tools.meta_rank.online_linear import quantize_online_linear_layers
from vllm_kimi_k3_moe.tools.meta_rank.rank import rank_zero_of
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    online_method_quantizers,
    whole_model_on_cpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.amd_gpu import (
    as_on_the_named_amd_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_attention import (
    rocm_mla_attention_kernels,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_model import (
    vllms_amd_model_on_cpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    OnlineQuantization,
    rank_vllm_config,
)

# What vLLM raises when it cannot build a layer for a deployment.
BUILD_ERRORS = (AssertionError, TypeError, ValueError, RuntimeError)


@contextmanager
def kimi_moe_class(model_module: Any, kimi_moe_cls: type) -> Iterator[None]:
    """Make ``KimiDecoderLayer`` build ``kimi_moe_cls``: it looks ``KimiMoE``
    up as a global of vLLM's model module when it builds. Restored on exit."""
    with replaced_attributes(model_module, KimiMoE=kimi_moe_cls):
        yield


def amd_kimi_moe_module() -> Any:
    """vLLM's ``vllm.models.kimi_k3.amd.linear`` (the plugin registered, so
    its ``KimiMoE`` is the plugin's)."""
    vllm_kimi_k3_moe.register()
    return importlib.import_module("vllm.models.kimi_k3.amd.linear")


def with_the_nvidia_signature(amd_kimi_moe_cls: type) -> Any:
    """A callable ``KimiDecoderLayer`` of vLLM's NVIDIA model builds as its
    ``KimiMoE`` (keywords ``vllm_config``, ``use_sequence_parallel`` and
    ``run_gemm_rs_ar`` besides), building ``amd_kimi_moe_cls`` as AMD's
    decoder layer does (config, quant_config, prefix, layer_idx): the
    hybrid build on an Intel GPU the module docstring describes."""

    def build(
        config: Any,
        vllm_config: Any = None,
        quant_config: Any = None,
        prefix: str = "",
        layer_idx: int = 0,
        use_sequence_parallel: bool = False,
        run_gemm_rs_ar: bool = False,
    ) -> Any:
        return amd_kimi_moe_cls(
            config=config, quant_config=quant_config, prefix=prefix, layer_idx=layer_idx
        )

    return build


@dataclass(frozen=True)
class RankBuild:
    """One build of the language model for rank 0 (on ``meta``): what it
    allocates, what its first MoE layer allocates, and the ``VllmConfig`` it
    was built under (which holds its attention layers, for the KV-cache
    specs)."""

    model: Any
    allocation: ModelAllocation
    placed: PlacedAllocation  # the same bytes, by where a pipeline stage holds them
    moe_layer: LayerAllocation
    vllm_config: Any
    draft: Any = None  # the speculative draft vLLM loaded next to it, if any
    # linear layers an online method quantized, and left as the BF16 they
    # allocated (``online_linear.quantize_online_linear_layers``)
    online_linear: tuple[int, int] = (0, 0)


def build_rank(
    kimi_moe_cls: type,
    text_config: dict[str, Any],
    deployment: Deployment,
    serving: Serving,
    model_dir: Path,
    pp_rank: int = 0,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    speculative: dict[str, Any] | None = None,
) -> RankBuild:
    """vLLM's ``KimiK3ForConditionalGeneration`` for rank 0 of
    ``deployment`` (of its pipeline stage ``pp_rank``, launched on nodes of
    ``gpus_per_node`` GPUs) on the ``meta`` device, its MoE layers built
    from ``kimi_moe_cls``, sized; with ``--speculative-config speculative``
    (``draft.for_vllm``'s), its draft too (``draft.build_draft``), counted
    on the last pipeline stage. With an AMD or Intel GPU named
    (``gpus.an_amd_gpu_named``), ``kimi_moe_cls`` is vLLM's AMD ``KimiMoE``
    (or upstream's of it), in vLLM's AMD model on ROCm, in the hybrid on XPU
    (the module docstring)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    arch = named_amd_arch()
    on_rocm = arch not in (None, XPU)
    # vLLM's draft loaders import its compiler's passes, which choose at
    # import, by platform, fusion passes that reference GPU ops: imported
    # here under this host's platform, not the stood-in GPU's (they compile
    # kernels and allocate nothing the tools size)
    importlib.import_module("vllm.compilation.backends")
    if on_rocm:  # vLLM's AMD model, as a whole
        model_module = importlib.import_module("vllm.models.kimi_k3.amd.model")
        moe_module, built_as = amd_kimi_moe_module(), kimi_moe_cls
    else:
        model_module = importlib.import_module("vllm.models.kimi_k3.nvidia.model")
        moe_module = model_module
        # on XPU the hybrid (the module docstring)
        built_as = (
            kimi_moe_cls if arch is None else with_the_nvidia_signature(kimi_moe_cls)
        )
    with ExitStack() as stack:
        stack.enter_context(rank_zero_of(deployment, pp_rank))
        stack.enter_context(whole_model_on_cpu())
        stack.enter_context(online_method_quantizers())
        stack.enter_context(kimi_moe_class(moe_module, built_as))
        stack.enter_context(as_on_the_named_amd_gpu())
        if on_rocm:
            stack.enter_context(vllms_amd_model_on_cpu())
            stack.enter_context(rocm_mla_attention_kernels())
        vllm_config = rank_vllm_config(
            model_dir,
            deployment,
            deployment.backend,
            serving,
            gpus_per_node=gpus_per_node,
            speculative=speculative,
            online=None
            if deployment.online is None
            else OnlineQuantization(deployment.online, deployment.online_config),
        )
        with set_current_vllm_config(vllm_config), torch.device("meta"):
            model = model_module.KimiK3ForConditionalGeneration(
                vllm_config=vllm_config, prefix=""
            )
        draft, draft_bytes = None, 0
        if vllm_config.speculative_config is not None:
            draft = build_draft(model, vllm_config)
            draft_bytes = sum(
                p.numel() * p.element_size() for _, p in own_parameters(draft, model)
            )
        online_linear = (0, 0)
        if deployment.online is not None:  # the linear layers it quantizes
            with set_current_vllm_config(vllm_config):
                online_linear = quantize_online_linear_layers(model)
    language_model = model.language_model.model
    # the first MoE layer this (pipeline stage's) rank holds
    first_moe = next(
        i for i in main_moe_layers(text_config) if i >= language_model.start_layer
    )
    kda_layer = KimiLinearConfig(**text_config).is_kda_layer
    # vLLM 0.34's DSA layers share one top-k buffer, allocated with the model
    topk = dsa_topk_indices_buffer(language_model)
    topk_bytes = 0 if topk is None else topk.numel() * topk.element_size()
    allocation = ModelAllocation.of(model, kda_layer)
    allocation.components["speculative_draft"] = draft_bytes
    allocation.components["dsa_topk_indices"] = topk_bytes
    placed = (
        PlacedAllocation.of(model, text_config["num_hidden_layers"], kda_layer)
        .with_draft(draft_bytes)
        .with_every_stage("dsa_topk_indices", topk_bytes)
    )
    kimi_moe = language_model.layers[first_moe].block_sparse_moe
    moe_layer = LayerAllocation.of(kimi_moe)
    if deployment.online is not None:  # what the GPU keeps: the quantized
        with set_current_vllm_config(vllm_config), online_method_quantizers():
            routed = quantized_routed_bytes(kimi_moe.experts.routed_experts)
        if routed is not None:
            moe_layer = moe_layer.with_routed_bytes(routed)
            placed = placed.with_routed_bytes(routed)
            allocation.components["moe_routed_experts"] = sum(
                layer["moe_routed_experts"] for layer in placed.layers
            )
    return RankBuild(
        model=model,
        allocation=allocation,
        placed=placed,
        moe_layer=moe_layer,
        vllm_config=vllm_config,
        draft=draft,
        online_linear=online_linear,
    )
