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
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.tools.topology import Serving, Topology

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


@functools.cache
def _model_config(model_dir: Path, serving: Serving | None) -> Any:
    """vLLM's ``ModelConfig`` of the model in ``model_dir``, parsed once (a
    tenth of a second): each ``VllmConfig`` gets a deep copy of it, so no
    config vLLM has seen is used twice. Without serving settings, the
    context length the model's config gives."""
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        **(
            {}
            if serving is None
            else {
                "max_model_len": serving.max_model_len,
                "language_model_only": serving.language_model_only,
            }
        ),
    )


def rank_vllm_config(
    model_dir: Path,
    topology: Topology,
    moe_backend: str,
    serving: Serving | None = None,
    device: str = "cpu",
) -> Any:
    """A fresh ``VllmConfig`` (and ``ModelConfig``: vLLM's model hooks run
    once per one, and vLLM refuses two layers of one name under one
    config) for a rank of ``topology`` as ``vllm serve --moe-backend
    moe_backend`` makes it on an NVIDIA GPU, for the model in ``model_dir``
    (``serving``: vLLM's defaults and the model's context length if not
    given), on ``device`` (``selftest`` builds on ``cuda`` where it has a
    GPU). Where this CPU box's platform turned off what CUDA keeps on (the
    hybrid KV-cache manager), CUDA's setting is put back."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KernelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = copy.deepcopy(_model_config(model_dir, serving))
    serving = serving or Serving(max_model_len=model_config.max_model_len)
    vllm_config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device=device),
        parallel_config=ParallelConfig(
            tensor_parallel_size=topology.tp_size,
            data_parallel_size=topology.dp_size,
            enable_expert_parallel=topology.expert_parallel,
            pipeline_parallel_size=topology.pp_size,
            decode_context_parallel_size=topology.dcp_size,
        ),
        kernel_config=KernelConfig(moe_backend=moe_backend),
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
