"""Where no layout of the advisor's GPUs fits, plan names the fewest GPUs of
that kind that fit, found by the planner's own sizing of each count."""

from __future__ import annotations

import shlex

import pytest

from tests.models.kimi_k3.conftest import sized_for
from vllm_kimi_k3_moe.tools.cli import build_parser
from vllm_kimi_k3_moe.tools.cli.plan import advisor_command
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.plan.next_step import (
    NextStep,
    fitting,
    next_step,
    next_step_lines,
)

# a GPU on which one does not hold Kimi-K3 and two do (TP1 PP2)
GIB = 1000


@pytest.fixture(scope="module")
def big_gpu_planner(kimi_k3_planner):
    """A planner of Kimi-K3 on GPUs of GIB, on the session's builds."""
    return sized_for(kimi_k3_planner, GpuBudget(GIB))


def test_the_fewest_gpus_that_fit_are_the_planners(big_gpu_planner):
    sized: list[int] = []

    def advise(gpus: int, quantization: str, backend: str):
        sized.append(gpus)
        return big_gpu_planner.advise(gpus, quantization, backend)

    one, _ = advise(1, "mxfp4", "marlin")
    assert not fitting(one)
    step = next_step(one, 1, 2, "mxfp4", "marlin", advise, big_gpu_planner.plan, False)
    assert step.fewest is not None and step.fewest.deployment.gpus == 2
    assert step.fewest.fits("fixed")
    assert step.on_whole_nodes is step.fewest  # 2 GPUs: one node of 2
    # the counts sized: the one asked, then from the lowest that could fit
    assert sized == [1, 2]


def test_the_next_step_is_a_plan_command_that_parses():
    args = build_parser().parse_args(
        ["plan", "--gpus", "8", "--gpu", "h200", "--max-model-len", "10k"]
    )
    command = advisor_command(args, 16, quantization="w4a16", moe_backend="marlin")
    words = shlex.split(command)
    assert words[:2] == ["vllm-kimi-k3-moe", "plan"]
    again = build_parser().parse_args(words[1:])
    assert (again.gpus, again.gpu, again.max_model_len) == (16, "h200", "10k")
    assert again.quantization == "w4a16" and again.moe_backend == "marlin"


def test_the_lines_name_each_step(big_gpu_planner):
    two, _ = big_gpu_planner.advise(2, "mxfp4", "marlin")
    step = NextStep(fitting(two)[0], None, 2, (), ("bf16",))
    lines = next_step_lines(step, 1, "1000 GiB", lambda n, **o: f"plan --gpus {n}")
    assert "Fewest of these GPUs that fit: 2" in "\n".join(lines)
    assert "    plan --gpus 2" in lines
    assert any("No other format fits 1 x 1000 GiB" in line for line in lines)


def test_the_advisor_ends_with_the_next_step(kimi_model, capsys, monkeypatch):
    """``plan --gpus 1`` where one GPU does not hold Kimi-K3: its last words
    are the plan command of the fewest that do, and what the other formats
    (here BF16 alone, to keep the test short) say."""
    from vllm_kimi_k3_moe.formats import bf16, mxfp4
    from vllm_kimi_k3_moe.tools.cli import main
    from vllm_kimi_k3_moe.tools.plan import next_step as searched

    monkeypatch.setattr(searched, "FORMATS", (mxfp4.RELEASE, bf16.BF16))
    asked = ["--gpu-memory-gib", str(GIB), "--gpus-per-node", "2"]
    assert main(["plan", "--gpus", "1", *asked]) == 0
    out = capsys.readouterr().out
    title = "1073.7 GB NVIDIA (assumed: no --gpu-arch)"  # 1000 GiB, in GB
    assert f"No layout of 1 x {title} fits" in out
    assert f"    vllm-kimi-k3-moe plan --gpus 2 {' '.join(asked)}" in out
    assert f"No other format fits 1 x {title} either (bf16" in out
