"""The ``vllm serve`` line ``plan`` prints, read back by vLLM 0.33.0's own
``vllm serve`` parser (as ``check --serve-command`` reads it), is the layout
it was printed for, on every node; vLLM's aliases and option forms read the
same."""

from __future__ import annotations

import pytest

from vllm_kimi_k3_moe.tools.check.serve_line import (
    ServeCommandError,
    read_serve_command,
)
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving, Topology
from vllm_kimi_k3_moe.tools.plan.serve_command import serve_commands

MODEL = "/models/Kimi K3"  # a space: the line quotes it


@pytest.mark.parametrize(
    ("deployment", "serving"),
    [
        (Deployment(8, dcp_size=8), Serving("fp8", 1048576)),
        (Deployment(32), Serving()),
        (Deployment(8, pp_size=2, dcp_size=4, backend="flashinfer_trtllm"), Serving()),
        (
            Deployment(4, pp_size=2, dp_size=2, expert_parallel=True, dcp_size=2),
            Serving(language_model_only=True),
        ),
    ],
    ids=lambda value: value.label() if isinstance(value, Deployment) else "",
)
def test_the_serve_line_reads_back_as_its_layout(kimi_model, deployment, serving):
    """Every node's line (one node's, or four for TP32 on nodes of 8)."""
    commands = serve_commands(deployment, serving, GpuBudget(141), MODEL)
    for rank, command in enumerate(commands):
        line = read_serve_command(command)
        assert line.model == MODEL
        assert line.topology == deployment.topology
        assert line.moe_backend == deployment.backend
        assert line.pcp_size == 1
        assert line.nodes.nodes == len(commands) and line.node_rank == rank
        assert line.headless == (rank > 0)


def test_vllms_aliases_and_forms_read_the_same(kimi_model):
    line = read_serve_command(
        "vllm serve /m -tp 4 -pp=2 -dcp 2 -ep --data-parallel-size=2 "
        "--prefill-context-parallel-size 3 --port 8001 -tp 8"  # the last -tp wins
    )
    assert line.topology == Topology(
        8, pp_size=2, dcp_size=2, dp_size=2, expert_parallel=True
    )
    assert line.pcp_size == 3 and line.moe_backend == "auto"


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("vllm serve /m --tensor-parallel-size eight", ["parser", "'eight'"]),
        ("vllm serve /m --no-such-option 1", ["unrecognized", "--no-such-option"]),
        ("vllm serve /m --moe-backend fastest", ["'fastest'"]),
        ("python -m vllm serve /m", ["must start with 'vllm serve'"]),
    ],
)
def test_what_vllm_refuses_is_one_line(kimi_model, command, words):
    with pytest.raises(ServeCommandError) as refusal:
        read_serve_command(command)
    assert "\n" not in str(refusal.value)
    for word in words:
        assert word in str(refusal.value)
