"""The ``VllmConfig`` a rank of a Kimi-K3 deployment is built under.

One builder for every build (planner, ``check --moe-backend``, tests): a
directory holding a ``config.json`` (a checkpoint's own, or a weightless one
``write_model_dir`` writes from a text config and a format's published
quantization config), read by vLLM's ``ModelConfig`` as ``vllm serve``
reads it, and the ``VllmConfig`` ``vllm serve`` makes around it for the
deployment: its topology, MoE backend, KV-cache dtype, context length and
prefix caching.
"""

from __future__ import annotations

from types import SimpleNamespace

import json
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.formats import KimiK3Format, mxfp4
from vllm_kimi_k3_moe.tools.build.stand_ins import MXFP4_FORMATS
from vllm_kimi_k3_moe.tools.topology import Deployment, Serving, Topology


def served_quantization_config(fmt: KimiK3Format) -> dict[str, Any] | None:
    """The ``quantization_config`` a Kimi-K3 checkpoint in ``fmt`` hands
    vLLM, after vLLM's own Kimi-K3 hook (which turns the release's
    compressed-tensors MXFP4 into native MXFP4; it runs for the multimodal
    architecture, not for the language model the planner builds)."""
    document = fmt.published_quantization_config()
    if fmt is mxfp4.RELEASE:
        from vllm.model_executor.models.config import (
            KimiK3ForConditionalGenerationConfig,
        )

        holder = SimpleNamespace(quantization_config=document)
        KimiK3ForConditionalGenerationConfig.verify_and_update_model_config(
            SimpleNamespace(
                hf_config=holder, hf_text_config=holder, model_arch_config=holder
            )
        )
    return document


def write_model_dir(
    text_config: dict[str, Any],
    quantization_config: dict[str, Any] | None,
    serving: Serving,
    directory: Path,
) -> Path:
    """Write a weightless ``config.json`` for the Kimi-K3 language model
    (``kimi_linear``, bfloat16) quantized as ``quantization_config`` says
    (for a format: ``served_quantization_config``) to ``directory``, and
    return the directory: vLLM resolves the format from it as from a
    checkpoint's."""
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
    if quantization_config is not None:
        document["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(document))
    return directory


def moe_backend_setting(deployment: Deployment) -> str:
    """The ``--moe-backend`` a deployment is built with. On the MXFP4
    formats ``marlin``, whatever kernel it names: ``stand_ins.
    mxfp4_backend_chosen`` makes vLLM pick that one (their names are
    ``Mxfp4MoeBackend``'s). The other formats take vLLM's own
    ``--moe-backend`` names."""
    return "marlin" if deployment.quantization in MXFP4_FORMATS else deployment.backend


def rank_vllm_config(
    model_dir: Path,
    topology: Topology,
    moe_backend: str,
    serving: Serving | None = None,
) -> Any:
    """A fresh ``VllmConfig`` (and ``ModelConfig``: vLLM's model hooks run
    once per one, and vLLM refuses two layers of one name under one
    config) for a rank of ``topology`` as ``vllm serve --moe-backend
    moe_backend`` makes it on an NVIDIA GPU, for the model in ``model_dir``
    (``serving``: vLLM's defaults and the model's context length if not
    given). Where this CPU box's
    platform turned off what CUDA keeps on (the hybrid KV-cache manager),
    CUDA's setting is put back."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KernelConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    # Without serving settings, the context length the model's config gives.
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        **({} if serving is None else {"max_model_len": serving.max_model_len}),
    )
    serving = serving or Serving(max_model_len=model_config.max_model_len)
    vllm_config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=topology.tp_size,
            data_parallel_size=topology.dp_size,
            enable_expert_parallel=topology.expert_parallel,
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
