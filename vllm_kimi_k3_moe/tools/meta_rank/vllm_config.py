"""The ``VllmConfig`` a rank of a Kimi-K3 deployment is built under.

One builder for every build (planner, ``check --moe-backend``, tests): a
directory holding a ``config.json`` (a checkpoint's own, or a weightless one
``write_model_dir`` writes as Kimi-K3's is published: the multimodal
``kimi_k3`` model, its language model under ``text_config``, a format's
published ``quantization_config``), read by vLLM's ``ModelConfig`` as
``vllm serve`` reads it (vLLM's own Kimi-K3 hook turns the release's
compressed-tensors MXFP4 into native MXFP4), and the ``VllmConfig``
``vllm serve`` makes around it for the deployment: its topology, MoE
backend, KV-cache dtype, context length, prefix caching and whether the
vision tower is loaded.
"""

from __future__ import annotations

import copy
import functools
import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.gpus import XPU, named_amd_arch
from vllm_kimi_k3_moe.tools.deployment.nodes import (
    DEFAULT_GPUS_PER_NODE,
    HEAD,
    MULTI_NODE_DP_BACKEND,
    node_split,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Serving, Topology
from vllm_kimi_k3_moe.tools.meta_rank.draft import speculative_config
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    cuda_extensible_kv_cache,
    cuda_graph_capture_sizes,
    cuda_hybrid_kv_cache,
    the_serving_gpus_capability,
)

# Kimi-K3's vision tower as published (MoonViT, 27 layers of 1024): vLLM's
# KimiK3VisionConfig defaults, which the published vision_config equals.
PUBLISHED_VISION_CONFIG: dict[str, Any] = {}


def write_model_dir(
    text_config: dict[str, Any],
    quantization_config: dict[str, Any] | None,
    serving: Serving,
    directory: Path,
) -> Path:
    """Write a weightless Kimi-K3 ``config.json`` (bfloat16, the language
    model ``text_config``, the vision tower as published) quantized as
    ``quantization_config`` says (a format's ``published_config``) to
    ``directory``, and return the directory: vLLM resolves the format from it
    as from a checkpoint's."""
    text = {
        **text_config,
        "model_type": "kimi_linear",
        # vLLM refuses a max_model_len above it; it sizes only the RoPE table
        "max_position_embeddings": max(
            serving.max_model_len, text_config.get("max_position_embeddings", 0)
        ),
    }
    document: dict[str, Any] = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": PUBLISHED_VISION_CONFIG,
    }
    if quantization_config is not None:
        document["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(document))
    return directory


@dataclass(frozen=True)
class OnlineQuantization:
    """``vllm serve --quantization NAME`` and ``--quantization-config JSON``:
    a method that quantizes the checkpoint's weights while vLLM loads them
    (``fp8_per_block``, ``mxfp4``, ``online`` with ``{"moe": ...}``), alone or,
    without ``NAME``, over the checkpoint's own ``quantization_config``."""

    quantization: str | None
    quantization_config: str | None = None  # JSON, as the flag takes it

    def model_config_fields(self) -> dict[str, Any]:
        """The two ``ModelConfig`` fields, as ``EngineArgs`` resolves the
        flags (vLLM's ``resolve_quantization_config``)."""
        from vllm.config.quantization import resolve_quantization_config

        config = self.quantization_config
        return {
            "quantization": self.quantization,
            "quantization_config": resolve_quantization_config(
                self.quantization, None if config is None else json.loads(config)
            ),
        }


def _capability_of_the_serving_gpus(on_this_gpu: bool) -> Any:
    """Nothing where the config is for this host's GPU (``selftest``); else
    ``stand_ins.the_serving_gpus_capability``."""
    return nullcontext() if on_this_gpu else the_serving_gpus_capability()


@functools.cache
def _model_config(
    model_dir: Path,
    serving: Serving | None,
    on_this_gpu: bool,
    online: OnlineQuantization | None = None,
) -> Any:
    """vLLM's ``ModelConfig`` of the model in ``model_dir``, parsed once (a
    tenth of a second): each ``VllmConfig`` gets a deep copy of it, so no
    config vLLM has seen is used twice. Without serving settings, the
    context length the model's config gives. Unless it is for this host's
    GPU (``on_this_gpu``), the dtype vLLM resolves is a serving GPU's.
    ``online``: quantized while loading, as its flags say."""
    from vllm.config import ModelConfig

    with _capability_of_the_serving_gpus(on_this_gpu):
        return ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            **({} if online is None else online.model_config_fields()),
            **(
                {}
                if serving is None
                else {
                    "max_model_len": serving.max_model_len,
                    "language_model_only": serving.language_model_only,
                }
            ),
        )


def parallel_config(
    topology: Topology, gpus_per_node: int = DEFAULT_GPUS_PER_NODE
) -> Any:
    """vLLM's ``ParallelConfig`` for ``topology`` as ``vllm serve`` makes it
    on node 0 of the launch ``plan`` prints (``tools/plan/serve_command.py``):
    over more than ``gpus_per_node`` GPUs, ``--nnodes N --node-rank 0
    --master-addr HEAD`` on the ``mp`` data-parallel backend, each node
    running the data-parallel ranks ``EngineArgs`` infers; and the
    distributed executor backend vLLM resolves on the serving nodes named
    (``mp``; vLLM picks ``uni`` itself for one GPU). Named, it is not asked of
    the host the tools run on: ``ParallelConfig.__post_init__`` otherwise
    refuses a world size above this host's GPU count on a CUDA host ("World
    size (32) is larger than the number of available GPUs (8) in this
    node"), which is no fact about the serving nodes."""
    from vllm.config import ParallelConfig

    split = node_split(topology, gpus_per_node)
    return ParallelConfig(
        tensor_parallel_size=topology.tp_size,
        data_parallel_size=topology.dp_size,
        enable_expert_parallel=topology.expert_parallel,
        pipeline_parallel_size=topology.pp_size,
        decode_context_parallel_size=topology.dcp_size,
        nnodes=split.nodes,
        node_rank=0,
        master_addr=HEAD,
        data_parallel_size_local=split.dp_per_node,
        data_parallel_backend=MULTI_NODE_DP_BACKEND,
        distributed_executor_backend="mp" if topology.gpus > 1 else None,
    )


def rank_vllm_config(
    model_dir: Path,
    topology: Topology,
    moe_backend: str,
    serving: Serving | None = None,
    device: str = "cpu",
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    speculative: dict[str, Any] | None = None,
    online: OnlineQuantization | None = None,
) -> Any:
    """A fresh ``VllmConfig`` (and ``ModelConfig``: vLLM's model hooks run
    once per one, and vLLM refuses two layers of one name under one
    config) for a rank of ``topology`` as ``vllm serve --moe-backend
    moe_backend`` makes it on an NVIDIA GPU, for the model in ``model_dir``
    (``serving``: vLLM's defaults and the model's context length if not
    given), on ``device`` (``selftest`` builds on ``cuda`` where it has a
    GPU), the nodes of ``gpus_per_node`` GPUs launched as ``parallel_config``
    says, with ``--speculative-config speculative`` (``draft.for_vllm``'s)
    if given, quantizing while it loads as ``online`` says if given. Built
    for GPUs that are not this host's (any device but
    ``cuda``), vLLM's checks see a serving GPU's compute capability
    (``stand_ins.the_serving_gpus_capability``); everywhere, a platform that
    keeps the hybrid KV-cache manager on, as CUDA's does
    (``stand_ins.cuda_hybrid_kv_cache``), captures CUDA graphs, sized by
    vLLM's rules (``stand_ins.cuda_graph_capture_sizes``), and settles the
    extensible KV cache as CUDA does (``stand_ins.cuda_extensible_kv_cache``;
    not for an Intel GPU named, ``gpus.an_amd_gpu_named``, where vLLM does
    not support it)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KernelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    on_this_gpu = device == "cuda"
    model_config = copy.deepcopy(_model_config(model_dir, serving, on_this_gpu, online))
    serving = serving or Serving(max_model_len=model_config.max_model_len)
    parallel = parallel_config(topology, gpus_per_node)
    with (
        _capability_of_the_serving_gpus(on_this_gpu),
        cuda_hybrid_kv_cache(),
        cuda_graph_capture_sizes(),
        # on an Intel GPU vLLM turns it off itself (CUDA and ROCm only)
        nullcontext() if named_amd_arch() == XPU else cuda_extensible_kv_cache(),
    ):
        vllm_config = VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig(device=device),
            parallel_config=parallel,
            kernel_config=KernelConfig(moe_backend=moe_backend),
            scheduler_config=SchedulerConfig(
                max_model_len=serving.max_model_len,
                is_encoder_decoder=False,
                enable_chunked_prefill=True,
            ),
            cache_config=CacheConfig(
                cache_dtype=serving.kv_cache_dtype, enable_prefix_caching=True
            ),
            speculative_config=None
            if speculative is None
            else speculative_config(speculative, model_config, parallel),
        )
    return vllm_config
