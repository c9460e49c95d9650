"""Every node's ``vllm serve`` line ``plan`` prints is one vLLM 0.33.0 launches:
read by vLLM's ``vllm serve`` parser, its engine config made by vLLM's own
``EngineArgs.create_engine_config`` (headless on the nodes other than 0), the
node split is the one ``tools/deployment/nodes.py`` states, and node 0's
``ParallelConfig`` is the one the tools build (``parallel_config``). vLLM's
launch rules refuse what ``split_over`` refuses, and nothing else."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.nodes import HEAD, node_split, split_over
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Serving,
    Topology,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import a_cuda_platform_for_the_parser
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    parallel_config,
    write_model_dir,
)
from vllm_kimi_k3_moe.tools.plan.serve_command import serve_commands

# (layout, GPUs per node, nodes vLLM's launch takes)
LAUNCHES = [
    (Deployment(32), 8, 4),  # one TP group over four nodes
    (Deployment(8, pp_size=2), 8, 2),  # the recipe's H200 layout (recipes #698)
    (Deployment(8, dp_size=4), 8, 4),  # one DP rank per node
    (Deployment(4, dp_size=4, expert_parallel=True), 8, 2),  # two DP ranks a node
    (Deployment(16, dp_size=2, expert_parallel=True), 8, 4),  # a replica, 2 nodes
    (Deployment(4, pp_size=3, dp_size=2), 8, 4),  # 3 nodes of 8 split a replica
    (Deployment(8, dcp_size=8), 8, 1),  # one node: no launch flags
]


@pytest.fixture(scope="module")
def engine_config(kimi_model):
    """The engine config ``vllm serve`` makes of a line's words, as vLLM's
    ``serve`` subcommand makes it (``EngineArgs.from_cli_args``, then
    ``create_engine_config(headless=...)``), for a weightless Kimi-K3."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with tempfile.TemporaryDirectory() as directory:
        model = write_model_dir(
            KIMI_K3_TEXT_CONFIG,
            mxfp4.RELEASE.published_quantization_config(),
            Serving(),
            Path(directory),
        )
        with a_cuda_platform_for_the_parser():
            parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

        def make(words: list[str]):
            with a_cuda_platform_for_the_parser():
                args = parser.parse_args(words)
                args.model = args.model_tag  # as vllm serve's command does
                return args, EngineArgs.from_cli_args(args).create_engine_config(
                    headless=args.headless
                )

        yield model, make


def line_words(command: str) -> list[str]:
    import shlex

    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"]
    return words[2:]


@pytest.mark.parametrize(
    ("deployment", "per_node", "nodes"),
    LAUNCHES,
    ids=[f"{d.label()}-{n}-nodes" for d, _, n in LAUNCHES],
)
def test_each_nodes_line_is_the_launch_vllm_makes(
    engine_config, deployment, per_node, nodes
):
    model, make = engine_config
    split = node_split(deployment, per_node)
    assert split.nodes == nodes
    lines = serve_commands(
        deployment, Serving(), GpuBudget(141), str(model), gpus_per_node=per_node
    )
    assert len(lines) == nodes
    for rank, line in enumerate(lines):
        args, config = make(line_words(line))
        parallel = config.parallel_config
        assert args.headless == (rank > 0)
        assert parallel.nnodes == nodes and parallel.node_rank == rank
        assert parallel.world_size * deployment.dp_size == deployment.gpus
        assert parallel.local_world_size == min(
            split.gpus_per_node, parallel.world_size
        )
        assert parallel.data_parallel_size_local == split.dp_per_node
        if nodes > 1:
            assert parallel.master_addr == HEAD
            assert parallel.distributed_executor_backend == "mp"
        if rank == 0:  # the tools build node 0's config
            ours = parallel_config(deployment, per_node)
            for field in (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "data_parallel_size",
                "data_parallel_size_local",
                "enable_expert_parallel",
                "decode_context_parallel_size",
                "nnodes",
                "node_rank",
                "nnodes_within_dp",
                "local_world_size",
                "data_parallel_backend",
                "distributed_executor_backend",
            ):
                assert getattr(ours, field) == getattr(parallel, field), field


# (layout, --nnodes): a node count each rule refuses, and one it takes.
SPLITS = [
    (Topology(32), 3, "evenly divide"),  # 32 GPUs are not 3 nodes
    (Topology(4, dp_size=3), 2, "node groups"),  # 6 GPUs a node: 1.5 replicas
    (Topology(4, pp_size=3, dp_size=2), 3, "node groups"),  # 8 of a 12-GPU replica
    (Topology(4, pp_size=3, dp_size=2), 4, None),
    (Topology(4, dp_size=3), 3, None),
]


@pytest.mark.parametrize(("topology", "nnodes", "refusal"), SPLITS)
def test_split_over_refuses_what_vllms_launch_refuses(
    engine_config, topology, nnodes, refusal
):
    """vLLM refuses while it makes the engine config (``--nnodes`` must
    divide the world size) or when its executor asks how many nodes a
    replica spans (``nnodes_within_dp``); ``split_over`` refuses the same."""
    model, make = engine_config
    words = [
        str(model),
        "--tensor-parallel-size",
        str(topology.tp_size),
        "--pipeline-parallel-size",
        str(topology.pp_size),
        "--data-parallel-size",
        str(topology.dp_size),
        "--nnodes",
        str(nnodes),
        "--master-addr",
        HEAD,
    ]
    try:
        _, config = make(words)
        assert config.parallel_config.local_world_size > 0  # the executor reads it
        vllm_refusal = None
    except ValueError as error:
        vllm_refusal = str(error)
    if refusal is None:
        assert vllm_refusal is None
        split_over(topology, nnodes)
        return
    assert vllm_refusal is not None and refusal in vllm_refusal
    with pytest.raises(DeploymentError, match=refusal):
        split_over(topology, nnodes)


@pytest.mark.parametrize(
    ("words", "refusal"),
    [
        (["--nnodes", "2", "--data-parallel-backend", "ray"], "requires"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    ],
)
def test_the_launch_flags_vllm_refuses(engine_config, words, refusal):
    """What ``nodes.validate_launch`` refuses besides the split, in vLLM's
    words."""
    from vllm_kimi_k3_moe.tools.deployment.nodes import validate_launch

    model, make = engine_config
    with pytest.raises(ValueError, match=refusal):
        make([str(model), "--tensor-parallel-size", "8", *words])
    rank = int(words[words.index("--node-rank") + 1]) if "--node-rank" in words else 0
    backend = words[-1] if "--data-parallel-backend" in words else "mp"
    with pytest.raises(DeploymentError, match=refusal):
        validate_launch(Topology(8), 2, rank, backend)


def test_the_lines_carry_the_speculative_config_vllm_takes(engine_config, tmp_path):
    """With ``--speculative-config`` every node's line carries it, and vLLM
    makes the DSpark draft's config from it (the kept public draft's
    ``config.json``, in a local directory as an operator's copy)."""
    from vllm_kimi_k3_moe.tools.deployment.speculation import read_speculative_config
    from vllm_kimi_k3_moe.tools.meta_rank.draft import write_draft_dir

    model, make = engine_config
    public = read_speculative_config(
        '{"method": "dspark", "model": "Inferact/Kimi-K3-DSpark"}',
        KIMI_K3_TEXT_CONFIG,
    )
    draft = write_draft_dir(public, tmp_path / "draft")
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7}
    lines = serve_commands(
        Deployment(16), Serving(), model=str(model), speculative_config=spec
    )
    assert len(lines) == 2
    for line in lines:
        _, config = make(line_words(line))
        speculative = config.speculative_config
        assert speculative.method == "dspark"
        assert speculative.num_speculative_tokens == 7
        assert speculative.draft_model_config.architectures == ["K3DSparkModel"]
        assert speculative.draft_parallel_config.tensor_parallel_size == 16
