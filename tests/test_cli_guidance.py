"""The command line guides a user who has not read the docs: a bare
``vllm-kimi-k3-moe`` lists the commands and how to get help, a misspelt
command, choice or option names the closest right one, every tool gives
the same TP sizes that work for one that does not, and what vLLM and torch
print while they are imported stays off the answer's screen unless
``--verbose``. None of these imports vLLM's model."""

from __future__ import annotations

import re

import pytest

from vllm_kimi_k3_moe.tools import cli
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm, show_what_vllm_prints
from vllm_kimi_k3_moe.tools.suggest import unrecognized


def refusal(capsys, *argv: str) -> str:
    """The one line ``vllm-kimi-k3-moe ARGV`` ends with, exit status 2."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_bare_command_lists_the_commands_and_how_to_get_help(capsys) -> None:
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    # each command's line starts with two spaces and its name
    commands = re.findall(r"^  (\S+)", err, re.M)
    assert commands[:4] == ["plan", "check", "selftest", "doctor"]
    assert "vllm-kimi-k3-moe COMMAND --help" in err
    assert "first:  vllm-kimi-k3-moe plan --gpu h20 --tp 32" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["plna"], "; did you mean 'plan'?"),
        (
            ["plan", "--tpp", "8"],
            "unrecognized arguments: --tpp (did you mean --tp?) 8",
        ),
        (["plan", "--kv-cache-dtype", "fp9"], "; did you mean 'fp8'?"),
        (
            ["check", "ckpt", "--serve-comand=vllm serve ckpt"],
            "--serve-comand=vllm serve ckpt (did you mean --serve-command?)",
        ),
    ],
)
def test_a_misspelling_names_the_closest_right_word(capsys, argv, said) -> None:
    assert said in refusal(capsys, *argv)


def test_an_unknown_word_far_from_every_option_is_only_refused() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp")
    assert unrecognized(["--zzzzzz"], parser) == "unrecognized arguments: --zzzzzz"


def test_every_tool_gives_the_tp_sizes_that_work(capsys) -> None:
    """plan's and selftest's refusals are one function's (check's is too,
    and its tests say so: it reads a checkpoint's config first)."""
    said = {
        tool: refusal(capsys, *argv).partition(": error: ")[2]
        for tool, argv in (
            ("plan", ["plan", "--tp", "7"]),
            ("selftest", ["selftest", "--tp", "7"]),
        )
    }
    assert said["plan"].endswith("; TP sizes that work: 1, 2, 4, 8, 16, 32")
    assert said["selftest"] == said["plan"]


def test_third_party_lines_stay_off_the_screen_unless_verbose(capfd) -> None:
    import os

    with quiet_vllm():
        os.write(2, b"W1204 torch/_opaque_base.py:6] deprecated\n")
    assert capfd.readouterr().err == ""
    show_what_vllm_prints(True)
    try:
        with quiet_vllm():
            os.write(2, b"W1204 torch/_opaque_base.py:6] deprecated\n")
    finally:
        show_what_vllm_prints(False)
    assert "deprecated" in capfd.readouterr().err


def test_verbose_is_every_tools_option() -> None:
    parser = cli.build_parser()
    for name in ("plan", "check", "selftest", "doctor"):
        args, _ = parser.parse_known_args([name, "--verbose"])
        assert args.verbose, name


def test_plot_needs_a_gpu_size_and_says_so_before_building(capsys) -> None:
    said = refusal(capsys, "plan", "--tp", "32", "--plot", "x.svg")
    assert said.endswith("give its size, --gpu NAME or --gpu-memory-gb X")
