"""One answer of ``plan``, one memory unit: GB (10^9 bytes, as its heading
says). The heading names the GPU with its memory in GB, the fits note gives
the same figure, and a GPU no preset names is given in GB as a datasheet
prints it (``--gpu-memory-gb``) or in GiB (``--gpu-memory-gib``), the
option said once, as given. Stdout and the notes on stderr together are the
answer an operator reads; the JSON says which GPU it planned for."""

from __future__ import annotations

import json
import re

import pytest

from vllm_kimi_k3_moe.formats import format_named
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.cli.plan import advisor_title
from vllm_kimi_k3_moe.tools.deployment.gpus import ALL_GPU_PRESETS, planned_for

# a binary unit anywhere in the answer (option names are lower case)
BINARY = re.compile(r"\b[KMGT]iB\b")


def answer(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    said = capsys.readouterr()
    return said.err + said.out


@pytest.mark.parametrize(
    ("argv", "title", "memory"),
    [
        (("--gpu", "h20", "--tp", "32"), "H20 (102.0 GB)", "102.0 GB"),
        (("--gpu", "mi300x", "--tp", "8"), "MI300X (206.1 GB)", "206.1 GB"),
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
    # the fits note gives the GPU's memory in the heading's GB, and no other
    assert f"each GPU's {memory} (as vLLM sees it;" in " ".join(said.split()), said
    assert not re.search(r"\d+ ?GB\b(?! =)", heading.replace(memory, "")), heading


def test_a_datasheets_gb_and_the_same_bytes_in_gib_are_one_answer(capsys) -> None:
    """200 GiB is 214.7483648 GB: the same plan, each said as given."""
    amd = ("--gpu-arch", "gfx942", "--tp", "8")
    in_gb = answer(capsys, "--gpu-memory-gb", "214.7483648", *amd)
    in_gib = answer(capsys, "--gpu-memory-gib", "200", *amd)  # kept: the same
    for said, given in ((in_gb, "gb 214.7483648"), (in_gib, "gib 200")):
        assert BINARY.findall(said) == [], said
        flat = " ".join(said.split())
        assert f"each GPU's 214.7 GB (as given: --gpu-memory-{given};" in flat
        # every other mention of the GPU is the same name, in GB
        names = re.findall(r"[\d.]+ GB AMD \w+", said)
        assert len(names) > 1 and set(names) == {"214.7 GB AMD gfx942"}, names
    # vLLM's import said above the first; the notes wrap the option anew
    table = " ".join(in_gb[in_gb.index("Kimi-K3 per GPU") :].split())
    assert table.replace("gb 214.7483648", "gib 200") in " ".join(in_gib.split())


def test_both_memory_options_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--gpu-memory-gb", "192", "--gpu-memory-gib", "180"])
    assert ended.value.code == 2
    assert "give --gpu-memory-gb or --gpu-memory-gib, not both" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("gpu", "arch", "capability", "expected"),
    [
        ("h20", None, (9, 0), ("nvidia", "sm_90", False)),
        ("b300", None, (10, 3), ("nvidia", "sm_103", False)),
        ("mi308x", "gfx942", None, ("amd", "gfx942", False)),
        ("max1550", "xpu", None, ("intel", "xpu", False)),
        (None, "gfx950", None, ("amd", "gfx950", False)),  # memory and --gpu-arch
        (None, None, None, ("nvidia", None, True)),  # a memory alone, or none
    ],
)
def test_the_json_says_which_gpu_it_planned_for(gpu, arch, capability, expected):
    said = planned_for(gpu, arch, capability)
    assert (said["vendor"], said["architecture"], said["vendor_assumed"]) == expected
    assert said["gpu"] == gpu


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


def test_a_memory_alone_plans_nvidia_and_its_json_says_assumed(capsys) -> None:
    said = answer(capsys, "--gpu-memory-gb", "192", "--tp", "8")
    assert "192.0 GB NVIDIA (assumed: no --gpu-arch) GPUs" in said
    assert main(["plan", "--gpu-memory-gb", "192", "--tp", "8", "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    assert document["planned_for"] == {
        "gpu": None,
        "vendor": "nvidia",
        "architecture": None,
        "vendor_assumed": True,
    }
    assert document["fits"]["gpu_memory_gib"] * 2**30 == 192 * 10**9


@pytest.mark.parametrize("preset", ALL_GPU_PRESETS.values(), ids=lambda p: p.name)
def test_the_advisors_first_line_fits_a_screen_on_every_preset(preset) -> None:
    """The GPU named with its memory made the heading longer: within 120
    columns on every preset, with the longest backend name plan gives it
    and more layouts than any advisor lists."""
    served = f"{format_named('mxfp4').title} on emulation"
    assert len(advisor_title(f"32 x {preset.title}", served, 111)) <= 120
