"""The ``vllm serve`` command line that asks vLLM for a planned deployment.

Each flag is vLLM's own (``EngineArgs.add_cli_args``; the suite parses every
command back with it). The checkpoint's format needs no flag: vLLM reads it
from the checkpoint's ``config.json``.
"""

from __future__ import annotations

import shlex

from vllm_kimi_k3_moe.tools.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.topology import Deployment, Serving

# What the command names the checkpoint when plan is not told (--model): the
# release's Hugging Face id, which vllm serve downloads (about 1.5 TB) unless
# it is given a local copy.
DEFAULT_MODEL = "moonshotai/Kimi-K3"


def serve_command(
    deployment: Deployment,
    serving: Serving,
    budget: GpuBudget | None,
    model: str = DEFAULT_MODEL,
) -> str:
    arguments = [
        "vllm",
        "serve",
        model,
        "--tensor-parallel-size",
        str(deployment.tp_size),
    ]
    if deployment.dcp_size > 1:
        arguments += ["--decode-context-parallel-size", str(deployment.dcp_size)]
    if deployment.pp_size > 1:
        arguments += ["--pipeline-parallel-size", str(deployment.pp_size)]
    if deployment.dp_size > 1:
        arguments += ["--data-parallel-size", str(deployment.dp_size)]
    if deployment.expert_parallel:
        arguments.append("--enable-expert-parallel")
    arguments += ["--moe-backend", deployment.backend]
    if serving.kv_cache_dtype != "auto":
        arguments += ["--kv-cache-dtype", serving.kv_cache_dtype]
    arguments += ["--max-model-len", str(serving.max_model_len)]
    if budget is not None:
        arguments += ["--gpu-memory-utilization", f"{budget.utilization:g}"]
    if serving.language_model_only:
        arguments.append("--language-model-only")
    return shlex.join(arguments)
