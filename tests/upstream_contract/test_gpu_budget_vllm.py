"""The GPU share ``plan`` sizes the KV cache in is the one vLLM makes of
the ``vllm serve`` line plan prints: vLLM's own ``EngineArgs`` make the
engine config of the line (as on the CUDA GPUs it is for), and its
``gpu_memory_utilization``, as vLLM resolves it, and its way of sizing the
KV cache (after warmup, or from the start-up profile) are plan's, with
``--gpu-memory-utilization`` given or not."""

from __future__ import annotations

import shlex

import pytest

from tests.models.kimi_k3.kimi_k3_formats import release_model_dir
from vllm_kimi_k3_moe import compat
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.kv_budget import kv_budget
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    a_cuda_platform_for_the_parser,
    cuda_extensible_kv_cache,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config
from vllm_kimi_k3_moe.tools.plan.serve_command import serve_commands

DEPLOYMENT = Deployment(8)  # one node: the line has no launch flags


@pytest.fixture(scope="module")
def model_dir(kimi_model):
    return release_model_dir()


def engine_config(line: str):
    """The engine config ``vllm serve`` makes of ``line``
    (``EngineArgs.from_cli_args``, then ``create_engine_config``), with the
    platform answering as CUDA where the parser and the extensible KV cache
    ask."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"]
    with a_cuda_platform_for_the_parser(), cuda_extensible_kv_cache():
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        args = parser.parse_args(words[2:])
        args.model = args.model_tag  # as vllm serve's command does
        return EngineArgs.from_cli_args(args).create_engine_config()


@pytest.mark.parametrize("utilization", [None, 0.9])
def test_the_serve_lines_share_is_the_one_plan_sized(model_dir, utilization):
    asked = GpuBudget(141, utilization)
    (line,) = serve_commands(DEPLOYMENT, Serving(), asked, str(model_dir))
    vllms = engine_config(line).cache_config
    ours = rank_vllm_config(model_dir, DEPLOYMENT, DEPLOYMENT.backend, Serving())
    budget = kv_budget(asked, ours.cache_config)
    assert budget.utilization == compat.resolved_gpu_memory_utilization(vllms)
    assert budget.after_warmup == (
        compat.kv_cache_sizing_after_warmup(vllms) is not None
    )
