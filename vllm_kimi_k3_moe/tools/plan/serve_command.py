"""The ``vllm serve`` command lines that launch a planned deployment, one per node.

The one place a layout becomes command lines: ``serve_commands`` takes a
deployment and how it is served and returns each node's line. Every flag is
vLLM's own (``EngineArgs.add_cli_args``; the suite parses every line back
with vLLM's ``vllm serve`` parser and makes vLLM's engine config from it).
Over several nodes the lines are vLLM's multiprocessing launch
(``tools/deployment/nodes.py``): every node gets the same line with ``--nnodes N
--node-rank R --master-addr HEAD``, the nodes other than 0 with
``--headless``; ``HEAD`` stands for node 0's address, which the operator
fills in. The checkpoint's format needs no flag: vLLM reads it from the
checkpoint's ``config.json``; a BF16 checkpoint quantized while loading gets
its method's ``--quantization NAME``. Where the kernel planned needs a
variable (AITER's on an AMD GPU), the line starts with it, as a shell
sets it for the one command.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.nodes import (
    DEFAULT_GPUS_PER_NODE,
    HEAD,
    node_split,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving

# What the command names the checkpoint when plan is not told (--model): the
# release's Hugging Face id, which vllm serve downloads (about 1.5 TB) unless
# it is given a local copy.
DEFAULT_MODEL = "moonshotai/Kimi-K3"


def serve_commands(
    deployment: Deployment,
    serving: Serving,
    budget: GpuBudget | None = None,
    model: str = DEFAULT_MODEL,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    speculative_config: dict[str, Any] | None = None,
    environment: tuple[str, ...] = (),
) -> list[str]:
    """The ``vllm serve`` line of each node that runs ``deployment`` on
    nodes of ``gpus_per_node`` GPUs (one line on one node), served as
    ``serving`` says, at ``budget``'s ``--gpu-memory-utilization`` where
    one was given (else vLLM's default), with
    ``--speculative-config`` as given (vLLM's JSON), after the
    ``environment`` it needs (``NAME=VALUE`` words, as a shell takes them
    before a command: ``VLLM_ROCM_USE_AITER=1 vllm serve ...``)."""
    arguments = [
        *environment,
        *_layout_and_serving(deployment, serving, budget, model, speculative_config),
    ]
    split = node_split(deployment, gpus_per_node)
    if not split.multi_node:
        return [shlex.join(arguments)]
    return [
        shlex.join(
            [
                *arguments,
                "--nnodes",
                str(split.nodes),
                "--node-rank",
                str(rank),
                "--master-addr",
                HEAD,
                *(["--headless"] if rank else []),
            ]
        )
        for rank in range(split.nodes)
    ]


def _layout_and_serving(
    deployment: Deployment,
    serving: Serving,
    budget: GpuBudget | None,
    model: str,
    speculative_config: dict[str, Any] | None,
) -> list[str]:
    """The words every node's line shares."""
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
    if deployment.online is not None:  # a BF16 checkpoint quantized while loading
        arguments += ["--quantization", deployment.online]
    if deployment.online_config is not None:
        arguments += ["--quantization-config", deployment.online_config]
    arguments += ["--moe-backend", deployment.backend]
    if serving.kv_cache_dtype != "auto":
        arguments += ["--kv-cache-dtype", serving.kv_cache_dtype]
    arguments += ["--max-model-len", str(serving.max_model_len)]
    # only as asked: unset, vLLM resolves its own default, which plan sized
    # with (and with its extensible KV cache vLLM advises leaving it unset)
    if budget is not None and budget.utilization is not None:
        arguments += ["--gpu-memory-utilization", f"{budget.utilization:g}"]
    if serving.language_model_only:
        arguments.append("--language-model-only")
    if speculative_config is not None:
        arguments += ["--speculative-config", json.dumps(speculative_config)]
    return arguments
