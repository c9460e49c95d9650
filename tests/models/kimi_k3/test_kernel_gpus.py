"""Which MoE kernels run on which GPU: vLLM's own selection for
``--moe-backend``, each kernel's device check answering as on a GPU of the
preset's compute capability (``stand_ins.a_gpu_of_capability``); ``plan
--gpu`` refuses a backend whose kernel does not run there, and a line on a
kernel that needs more room carries the utilization it is run at."""

from __future__ import annotations

import shlex

import pytest

from vllm_kimi_k3_moe.tools.cli import build_parser, main
from vllm_kimi_k3_moe.tools.cli.plan import _plan_input
from vllm_kimi_k3_moe.tools.deployment.gpus import GPU_PRESETS
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.kernel_gpus import GPU_CAPABILITY, kernel_on_gpu
from vllm_kimi_k3_moe.tools.plan.serve_command import serve_commands

HOPPER, B200, B300 = (9, 0), (10, 0), (10, 3)


def test_every_gpu_preset_has_its_compute_capability() -> None:
    assert set(GPU_CAPABILITY) == set(GPU_PRESETS)


@pytest.mark.parametrize(
    ("quantization", "backend", "runs_on"),
    [
        # FlashInfer's TRT-LLM MoE kernels are Blackwell-only (SM100 family)
        ("mxfp4", "flashinfer_trtllm", {B200, B300}),
        ("mxfp4", "marlin", {HOPPER, B200, B300}),
        # vLLM's CUTLASS FP4 MoE and FlashInfer's CuTe DSL need Blackwell too
        ("nvfp4", "cutlass", {B200, B300}),
        ("nvfp4", "flashinfer_cutedsl", {B200, B300}),
        ("nvfp4", "marlin", {HOPPER, B200, B300}),
    ],
)
def test_vllm_selects_a_kernel_on_the_gpus_it_runs_on(
    kimi_model, quantization, backend, runs_on
) -> None:
    # a pipeline too: each stage runs the kernel the first one does
    deployment = Deployment(8, pp_size=2, backend=backend, quantization=quantization)
    for capability in (HOPPER, B200, B300):
        answer = kernel_on_gpu(KIMI_K3_TEXT_CONFIG, deployment, capability)
        assert answer.runs == (capability in runs_on), (capability, answer)
        if answer.runs:
            assert answer.verified and answer.refusal is None
        else:  # vLLM's own words
            assert "does not support" in answer.refusal


def test_plan_refuses_a_kernel_the_gpu_cannot_run(kimi_model, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "plan",
                "--gpu",
                "h100",
                "--tp",
                "32",
                "--ep",
                "--moe-backend",
                "flashinfer_trtllm",
            ]
        )
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(
        "vllm-kimi-k3-moe plan: error: --moe-backend flashinfer_trtllm does not "
        "run on h100 (compute capability 9.0): vLLM selects no kernel for it there"
    )
    runs = error.split("; on h100 mxfp4 runs on ")[1]
    assert runs.startswith("marlin, humming")
    assert "flashinfer_trtllm" not in runs


def test_a_kernel_that_needs_room_is_sized_and_served_with_it(capsys) -> None:
    """FlashInfer's TRT-LLM MXFP4 kernel at vLLM's recipe's 0.90, unless
    the operator gives a utilization; Marlin at vLLM's default (unset)."""
    parse = build_parser().parse_args
    asked = _plan_input(
        parse(
            ["plan", "--gpu", "b200", "--tp", "8", "--moe-backend", "flashinfer_trtllm"]
        )
    )
    assert asked.budget.utilization == 0.90
    assert "--gpu-memory-utilization 0.9" in capsys.readouterr().err
    (line,) = serve_commands(asked.deployments[0], Serving(), asked.budget)
    words = shlex.split(line)
    assert words[words.index("--moe-backend") + 1] == "flashinfer_trtllm"
    assert words[words.index("--gpu-memory-utilization") + 1] == "0.9"
    given = ["--gpu-memory-utilization", "0.85"]
    args = ["plan", "--gpu", "b200", "--moe-backend", "flashinfer_trtllm", *given]
    assert _plan_input(parse(args)).budget.utilization == 0.85
    marlin = _plan_input(parse(["plan", "--gpu", "b200", "--tp", "8"]))
    assert marlin.budget.utilization is None
