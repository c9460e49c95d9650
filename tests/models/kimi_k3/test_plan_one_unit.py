"""One answer of ``plan``, one memory unit: GB (10^9 bytes, as its heading
says), the GPU named once in the heading, its memory as vLLM sees it in the
fits note, and the GiB ``--gpu-memory-gib`` was given said once, as given.
Stdout and the notes on stderr together are the answer an operator reads."""

from __future__ import annotations

import re

import pytest

from vllm_kimi_k3_moe.tools.cli import main

# a binary unit anywhere in the answer (option names are lower case)
BINARY = re.compile(r"\b[KMGT]iB\b")


def answer(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    said = capsys.readouterr()
    return said.err + said.out


@pytest.mark.parametrize(
    ("argv", "title", "memory"),
    [
        (("--gpu", "h20", "--tp", "32"), "H20 96GB", "102.0 GB"),
        (("--gpu", "mi300x", "--tp", "8"), "MI300X 192GB", "206.1 GB"),
    ],
)
def test_a_preset_answer_counts_in_gb_and_names_its_gpu_once(
    capsys, argv, title, memory
) -> None:
    said = answer(capsys, *argv)
    assert BINARY.findall(said) == [], said
    assert said.count(title) == 1, said
    heading = next(line for line in said.splitlines() if line.startswith("Kimi-K3"))
    assert heading.endswith(f"GB = 10^9 bytes, {title} GPUs"), heading
    # the fits note gives the GPU's memory in the heading's GB
    assert f"each GPU's {memory} (as vLLM sees it;" in " ".join(said.split()), said


def test_a_memory_given_in_gib_is_said_once_as_given(capsys) -> None:
    said = answer(
        capsys, "--gpu-memory-gib", "191.98", "--gpu-arch", "gfx942", "--tp", "8"
    )
    assert BINARY.findall(said) == ["GiB"], said
    assert "each GPU's 206.1 GB (191.98 GiB as given;" in " ".join(said.split())
    # every other mention of the GPU is the same name, in GB
    names = re.findall(r"[\d.]+ GB AMD \w+", said)
    assert len(names) > 1 and set(names) == {"206.1 GB AMD gfx942"}, names
    assert said.count("191.98") == 1, said


def test_the_kda_state_per_request_names_its_layout(capsys) -> None:
    said = " ".join(answer(capsys, "--gpu", "h20").split())
    # the default TP sizes: one figure for each, halving as TP doubles
    found = {tp: int(mb) for mb, tp in re.findall(r"(\d+) MB at TP(\d+)", said)}
    assert set(found) == {"8", "16", "32"}, said
    assert found["8"] == 2 * found["16"] == 4 * found["32"], found


def test_plan_help_lists_the_presets_in_the_answers_gb(capsys) -> None:
    """``plan --help`` names each preset's memory as its answers do (the
    figures ``test_a_preset_answer_counts_in_gb_and_names_its_gpu_once``
    reads from the fits note), not in GiB."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    presets = text[text.index("GPUs (--gpu): ") :].split(": the memory")[0]
    assert "h20 (102.0 GB)" in presets and "mi300x (206.1 GB)" in presets
    assert BINARY.findall(presets) == [], presets
