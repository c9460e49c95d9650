"""Every AMD GPU an operator has: the MI308X and MI350X presets, any other by
``--gpu-memory-gib`` and ``--gpu-arch``, plan the AMD model vLLM builds
there on the MoE backend vLLM selects there (AITER's on CDNA4, as vLLM's
recipe serves it; the emulation experts on CDNA3); a memory alone says on
the first line that it assumed NVIDIA (``test_plan_one_unit``); a backend
that needs AITER's switch names it where it is off.

Why: ``plan --gpu-memory-gib 191.98`` planned an MI308X as an NVIDIA GPU
without a word (Marlin, and TP16 as "vLLM: yes", which raises on every AMD
GPU), and ``--moe-backend aiter`` failed with "current device None". The
backend each question plans on is vLLM's own selection (its MXFP4 oracle
and Kimi-K3's AITER route), asked under ROCm's platform stand-in for the
architecture; nothing here restates which backend vLLM picks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.header_set import write as write_header_set
from vllm_kimi_k3_moe.tools.cli import build_parser, main
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    AITER_VARIABLE,
    ALL_GPU_PRESETS,
    gpu_preset,
)
from vllm_kimi_k3_moe.tools.plan.asked import plan_input


@pytest.fixture(autouse=True)
def recipe_aiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """AITER's switch unset: plan plans as vLLM's recipe serves each GPU."""
    monkeypatch.delenv(AITER_VARIABLE, raising=False)


def asked(*words: str):
    """What ``plan`` makes of ``words`` (vLLM asked for its backend there)."""
    args = build_parser().parse_args(["plan", *words])
    return plan_input(args, lambda line: None)


@pytest.mark.parametrize(
    ("gpu", "arch", "backend", "aiter"),
    [
        ("mi308x", "gfx942", "emulation", False),
        ("mi350x", "gfx950", "aiter", True),
        ("mi355x", "gfx950", "aiter", True),
    ],
)
def test_each_amd_preset_plans_vllms_amd_model_on_its_backend(
    gpu, arch, backend, aiter
) -> None:
    question = asked("--gpu", gpu, "--tp", "8")
    assert gpu_preset(gpu).vendor == "amd"
    assert (question.amd_arch, question.backend, question.aiter) == (
        arch,
        backend,
        aiter,
    )


def test_the_presets_memory_is_what_hip_reports_on_their_siblings() -> None:
    """MI308X is an MI300X's memory, MI350X an MI355X's (no HIP figure of
    their own was found; the comments in ``gpus`` say so)."""
    assert ALL_GPU_PRESETS["mi308x"].memory_gib == 191.98
    assert ALL_GPU_PRESETS["mi350x"].memory_gib == 287.98


@pytest.mark.parametrize(
    ("arch", "backend"), [("gfx942", "emulation"), ("gfx950", "aiter")]
)
def test_an_unlisted_amd_gpu_by_memory_and_arch_is_planned_as_amd(
    arch, backend
) -> None:
    question = asked("--gpu-memory-gib", "200", "--gpu-arch", arch, "--tp", "8")
    assert (question.amd_arch, question.backend) == (arch, backend)
    assert question.gpu_title == f"214.7 GB AMD {arch}"


def test_emulation_on_request_on_cdna4() -> None:
    question = asked("--gpu", "mi355x", "--moe-backend", "emulation", "--tp", "8")
    assert question.backend == "emulation"


def test_gpu_arch_is_for_a_memory_only(capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--gpu", "mi300x", "--gpu-arch", "gfx950", "--tp", "8"])
    assert ended.value.code == 2
    assert "--gpu mi300x has its own" in capsys.readouterr().err


def test_an_unknown_gpu_lists_the_presets_and_the_arch_option(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--gpu", "mi999", "--tp", "8"])
    said = capsys.readouterr().err
    assert "mi308x" in said and "mi350x" in said and "--gpu-arch" in said


def test_aiter_without_its_switch_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv(AITER_VARIABLE, "0")
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--gpu", "mi355x", "--tp", "8", "--moe-backend", "aiter"])
    assert ended.value.code == 2
    assert f"needs {AITER_VARIABLE}=1 on mi355x" in capsys.readouterr().err


@pytest.fixture(scope="module")
def header_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's config.json, index and shard headers (no data)."""
    directory = tmp_path_factory.mktemp("release-header-set")
    write_header_set(directory)
    return directory


def test_mi355x_serve_line_carries_aiter_and_check_takes_it_as_printed(
    header_set: Path, capsys
) -> None:
    """The TP8 line plan prints for 8 MI355X starts with AITER's switch;
    ``check`` reads it (vLLM's parser, AITER as the line sets it) and
    passes; the same line without the switch is refused, naming it."""
    asked = ["plan", "--gpu", "mi355x", "--tp", "8", "--json"]
    assert main([*asked, "--model", str(header_set)]) == 0
    (plan,) = json.loads(capsys.readouterr().out)
    (line,) = plan["serve_commands"]
    assert line.startswith(f"{AITER_VARIABLE}=1 vllm serve ")
    assert "--moe-backend aiter" in line
    assert main(["check", "--gpu", "mi355x", "--serve-command", line]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("OK "), out
    bare = line.removeprefix(f"{AITER_VARIABLE}=1 ")
    with pytest.raises(SystemExit) as ended:
        main(["check", "--gpu", "mi355x", "--serve-command", bare])
    assert ended.value.code == 2
    assert f"needs {AITER_VARIABLE}=1 on mi355x" in capsys.readouterr().err
