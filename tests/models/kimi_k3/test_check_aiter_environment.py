"""``check`` says where a server's environment sets AITER's SiTUv2 variables
that vLLM replaces: public AMD launch lines set ``AITER_SITUV2_A8W4=1``
without vLLM's ``VLLM_ROCM_USE_AITER_MOE_SITUV2``, whose default (auto:
a4w4) vLLM writes over it in each of its processes. What vLLM does is
asked of vLLM's own functions (both releases have them); the allocation is
the same for each activation (``amd/test_amd_situv2.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    write_header_only_checkpoint,
)
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.tools.check.aiter_environment import (
    SITUV2_VARIABLE,
    AiterEnvironmentError,
    replaced_situv2,
)
from vllm_kimi_k3_moe.tools.cli import main

A8W4 = {"AITER_SITUV2_A8W4": "1"}  # as the public launch lines set it


def test_the_public_lines_a8w4_is_replaced_by_vllms_default() -> None:
    import vllm  # noqa: F401  (what its import sets is not in question)

    before = dict(os.environ)
    replaced = replaced_situv2(A8W4)
    assert os.environ == before  # vLLM's AITER functions ran on a copy
    assert replaced is not None
    assert replaced.given == A8W4
    assert replaced.kept == {"AITER_SITUV2_A4W4": "1"}
    assert replaced.activation == "a4w4"
    assert replaced.to_dict()["instead"] == f"{SITUV2_VARIABLE}=a8w4"


@pytest.mark.parametrize(
    "environment",
    [
        {},
        {"VLLM_ROCM_USE_AITER": "1"},
        {**A8W4, SITUV2_VARIABLE: "a8w4"},  # what to set: vLLM keeps it
        {"AITER_SITUV2_A4W4": "1"},  # what vLLM's default sets anyway
        {SITUV2_VARIABLE: "a16w4"},
    ],
)
def test_nothing_is_said_where_vllm_keeps_what_is_set(environment) -> None:
    assert replaced_situv2(environment) is None


def test_a16w4_asked_of_vllm_removes_both() -> None:
    replaced = replaced_situv2({**A8W4, SITUV2_VARIABLE: "a16w4"})
    assert replaced is not None and replaced.kept == {}
    assert replaced.activation == "a16w4"


def test_a_value_vllm_refuses_is_refused_naming_it() -> None:
    refused = r"would not start: .*'a8w8'.*VLLM_ROCM_USE"
    with pytest.raises(AiterEnvironmentError, match=refused):
        replaced_situv2({SITUV2_VARIABLE: "a8w8"})


def test_check_of_the_serve_line_says_what_vllm_runs_and_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_header_only_checkpoint(tmp_path, KimiK3Spec())
    line = (
        f"VLLM_ROCM_USE_AITER=1 AITER_SITUV2_A8W4=1 vllm serve {tmp_path} "
        "--tensor-parallel-size 8"
    )
    assert main(["check", "--serve-command", line, "--gpu", "mi355x"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert (
        f"AITER AITER_SITUV2_A8W4=1 has no effect: {VLLM} sets AITER's SiTUv2 "
        f"variables in each of its processes, from {SITUV2_VARIABLE} (unset: auto), "
        "to AITER_SITUV2_A4W4=1: Kimi-K3's AITER MoE (CDNA4, AITER on) runs a4w4. "
        f"For a8w4 set {SITUV2_VARIABLE}=a8w4 instead."
    ) in said
    assert said.endswith("and vLLM builds this topology")  # the verdict, clean
    assert main(["check", "--serve-command", line, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["aiter_situv2"]["instead"] == f"{SITUV2_VARIABLE}=a8w4"
