"""``plan --gpus 16 --gpu mi300x`` names every layout that serves Kimi-K3 on
16 MI300X: those vLLM alone builds (TP8 x DP2, and TP8 or less with expert
parallelism) and TP16, with or without EP, which only the plugin builds,
each said with vLLM alone's reason; and ``check --gpu mi300x`` takes the
serve lines it prints.

Why: on ROCm vLLM builds Kimi-K3's MoE from ``vllm/models/kimi_k3/amd``,
whose ``KimiMoE`` raises at every tensor-parallel size of 16 or more; an
operator with 16 MI300X (Kimi-K3 does not fit 8 of 192 GB) must be told
that TP16 is the plugin's and TP8 x DP2 is both's. The routed-expert
figures are checked against the checkpoint's shapes, computed here: rows
per GPU as the emulation experts (vLLM's default on MI300X) hold them,
the slice of 3072 rounded up to 32, times the MXFP4 bytes of one row of
gate, up and down at the latent width.

Plan runs once for the module (about 45 s, vLLM imported), its answers kept
in a directory of the module's own; the JSON is then a kept answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.header_set import write as write_header_set
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.remembered import (
    CACHE_VARIABLE,
    vllm_environment,
)
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG

ASKED = ["plan", "--gpus", "16", "--gpu", "mi300x"]


@pytest.fixture(scope="module")
def header_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's config.json, index and shard headers (no data)."""
    directory = tmp_path_factory.mktemp("release-header-set")
    write_header_set(directory)
    return directory


@pytest.fixture(scope="module")
def advice(
    header_set: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict]]:
    """What ``plan --gpus 16 --gpu mi300x --model HEADER_SET`` prints: the
    table and its JSON (asked again: the kept answer), exit status 0."""
    printed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_VARIABLE, str(tmp_path_factory.mktemp("answers")))
        vllm_environment.cache_clear()
        for extra in ([], ["--json"]):
            capture = tmp_path_factory.mktemp("out") / "stdout"
            with capture.open("w") as out, pytest.MonkeyPatch.context() as io:
                io.setattr("sys.stdout", out)
                assert main([*ASKED, "--model", str(header_set), *extra]) == 0
            printed.append(capture.read_text())
    vllm_environment.cache_clear()
    return printed[0], json.loads(printed[1])


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by layout: the cells after the layout's name."""
    table = {}
    for line in text.splitlines():
        match = re.match(r"(TP\d+(?: \w+)*?)\s{2,}(\d+\s.*)$", line)
        if match:
            table[match.group(1)] = match.group(2).split()
    return table


def by_layout(plans: list[dict]) -> dict[tuple[int, int, bool], dict]:
    """The JSON's plans without PP or DCP, by (TP, DP, EP)."""
    return {
        (d["tp_size"], d["dp_size"], d["expert_parallel"]): plan
        for plan in plans
        if (d := plan["deployment"])["pp_size"] == 1 and d["dcp_size"] == 1
    }


def routed_bytes_per_gpu(experts: int, rows_per_expert: int) -> int:
    """The checkpoint's routed-expert MXFP4 bytes a GPU holds over every MoE
    layer: per expert row, gate's and up's row and down's column of the
    latent width, each 4-bit values (2 per byte) and one E8M0 scale per 32."""
    config = KIMI_K3_TEXT_CONFIG
    latent = config["routed_expert_hidden_size"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    row = 3 * (latent // 2 + latent // 32)
    return moe_layers * experts * rows_per_expert * row


EMULATION_ALIGNMENT = 32  # vLLM's OCP MX emulation experts round rows up to it
SLICE_OF_16 = -(-3072 // 16 // EMULATION_ALIGNMENT) * EMULATION_ALIGNMENT


def test_tp16_is_listed_as_the_plugins_with_why_and_tp8_x_dp2_as_both(
    advice,
) -> None:
    text, _ = advice
    table = rows(text)
    for layout in ("TP16", "TP16 EP"):  # vLLM alone: "-", not fitting
        assert table[layout][2:6] == ["-", table[layout][3], "no", "yes"]
        assert "alone cannot build it" in " ".join(table[layout])
    for layout in ("TP8 DP2", "TP8 DP2 EP"):  # both build it, the same
        alone, plugin, fits_alone, fits = table[layout][2:6]
        assert (alone, fits_alone, fits) == (plugin, "yes", "yes")
    why = " ".join(text.split())
    said = re.search(r"alone cannot build ([^:]*): AttributeError", why)
    assert said is not None, text
    assert {"TP16", "TP16 EP"} <= set(said.group(1).split(", "))
    assert "w13_weight_packed" in why and "amd/linear.py" in why
    assert "--moe-backend emulation" in text


def test_routed_experts_per_gpu_are_the_checkpoints_slices(advice) -> None:
    _, plans = advice
    plans = by_layout(plans)
    tp16 = routed_bytes_per_gpu(896, SLICE_OF_16)  # 90.4 GB
    ep16 = routed_bytes_per_gpu(896 // 16, 3072)  # whole experts, 56 a GPU
    assert tp16 == ep16 == 90_403_504_128
    for layout, expected, alone in [
        ((16, 1, False), tp16, None),
        ((16, 1, True), ep16, None),
        ((8, 2, False), tp16, tp16),
        ((8, 2, True), ep16, ep16),
    ]:
        moe = plans[layout]["all_moe_layers"]
        assert moe["fixed_routed_bytes"] == expected, layout
        assert moe["upstream_routed_bytes"] == alone, layout
    assert "w13_weight_packed" in plans[16, 1, False]["upstream_refusal"]
    assert plans[8, 2, False]["upstream_refusal"] is None


@pytest.mark.parametrize(
    "layout", [(16, 1, False), (16, 1, True), (8, 2, False)], ids=str
)
def test_check_takes_the_printed_serve_lines(advice, layout, capsys) -> None:
    _, plans = advice
    lines = by_layout(plans)[layout]["serve_commands"]
    assert "--moe-backend emulation" in lines[0]
    # the head node's (a headless node's has the same layout)
    status = main(["check", "--gpu", "mi300x", "--serve-command", lines[0]])
    out = capsys.readouterr().out
    assert status == 0 and out.splitlines()[-1].startswith("OK "), out
