"""The command line: ``--version`` from package metadata, subcommands dispatched
through the function each one names, and ``check`` without ``--moe-backend``
importing neither torch nor vLLM (only the metadata and the shard headers)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    checkpoint_tensors,
    split_into_shards,
    write_checkpoint,
)
from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.tools import cli

REPO = Path(__file__).parents[1]
SUPPORTED_SERIES = "0.33.x or 0.34.x"  # compat.SUPPORTED_VLLM_SERIES
# .ci/constraints*.txt pin one of the two releases the suite runs on
INSTALLED_VLLM = importlib.metadata.version("vllm")
assert INSTALLED_VLLM in ("0.33.0", "0.34.0")
HEAVY = ("torch", "vllm")  # each takes seconds to import
HUMMING = "HUMMING_DISABLE_PARALLEL_BUILD"

# Runs the command line in a fresh interpreter, then reports on stderr which
# of HEAVY it imported.
IMPORT_PROBE = f"""
import json, sys
from vllm_kimi_k3_moe.tools.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
print(json.dumps(sorted(set(sys.modules) & set({HEAVY!r}))), file=sys.stderr)
sys.exit(status)
"""


def run_fresh(*argv: str) -> tuple[int, str, list[str]]:
    """(exit status, stdout, heavy modules imported) of a fresh process."""
    status, out, imported, _ = run_fresh_with_stderr(*argv)
    return status, out, imported


def run_fresh_with_stderr(*argv: str) -> tuple[int, str, list[str], str]:
    """``run_fresh``'s answer and what the command wrote on stderr."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,  # imports this tree's package
    )
    *err, imported = result.stderr.strip().splitlines()
    return result.returncode, result.stdout, json.loads(imported), "\n".join(err)


def test_version_names_plugin_supported_and_installed_vllm(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    plugin = importlib.metadata.version("vllm-kimi-k3-moe")
    assert capsys.readouterr().out == (
        f"vllm-kimi-k3-moe {plugin}\n"
        f"supported vLLM {SUPPORTED_SERIES}\n"
        f"installed vLLM {INSTALLED_VLLM}\n"
    )


def test_version_without_vllm_installed(monkeypatch, capsys) -> None:
    def version(distribution: str) -> str:
        if distribution == "vllm":
            raise importlib.metadata.PackageNotFoundError(distribution)
        return "9.9.9"

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.splitlines() == [
        "vllm-kimi-k3-moe 9.9.9",
        f"supported vLLM {SUPPORTED_SERIES}",
        "installed vLLM not installed",
    ]


def test_version_reads_metadata_only() -> None:
    status, out, imported = run_fresh("--version")
    assert status == 0
    assert out.splitlines()[1:] == [
        f"supported vLLM {SUPPORTED_SERIES}",
        f"installed vLLM {INSTALLED_VLLM}",
    ]
    assert imported == []


def test_check_without_moe_backend_imports_neither_torch_nor_vllm(
    tmp_path: Path,
) -> None:
    spec = KimiK3Spec()
    write_checkpoint(
        tmp_path, spec, split_into_shards(checkpoint_tensors(spec), spec.shards)
    )
    status, out, imported = run_fresh("check", str(tmp_path))
    assert status == 0, out
    assert out.splitlines()[-1].startswith("OK ")
    assert imported == []


@pytest.mark.parametrize(
    ("argv", "subcommand", "parsed"),
    [
        (["plan", "--tp", "8", "32"], cli.plan, {"tp_sizes": [8, 32]}),
        (["check", "ckpt", "--ep"], cli.check, {"expert_parallel": True}),
        (["selftest", "--tp", "16", "--ep"], cli.selftest, {"tp_size": 16}),
    ],
)
def test_main_runs_the_function_the_subcommand_names(
    monkeypatch, argv, subcommand, parsed
) -> None:
    """Each subcommand's parser names its run function; main calls it with
    the parsed arguments and returns its status."""
    calls = []
    monkeypatch.setattr(subcommand, "run", lambda args: calls.append(args) or 7)
    assert cli.main(argv) == 7
    (args,) = calls
    for name, value in parsed.items():
        assert getattr(args, name) == value


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["serve"], "invalid choice: 'serve'"),
        (["check"], "give CHECKPOINT_DIR, or --serve-command"),
    ],
)
def test_no_or_unknown_subcommand_is_one_line_and_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert words in err


def test_help_names_the_subcommands_and_version(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = capsys.readouterr().out
    for word in ("plan", "check", "--version", "supports"):
        assert word in help_text


def test_check_help_names_every_format_and_exit_status(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    # argparse wraps lines (at hyphens too): compare without whitespace
    text = "".join(capsys.readouterr().out.split())
    for fmt in FORMATS:
        assert "".join(fmt.title.split()) in text, fmt.name
    for status in (
        "Exitstatus:0clean;1problemsfound",
        "2unusableinput,onelineonstderr",
        "atopologyvLLMcannotbuild(asplanrefusesit)",
        "afileinsteadofadirectory",
    ):
        assert status in text
    for option in ("--all", "--json", "--moe-backend", "--tp", "--dp", "--ep"):
        assert option in text


def test_readme_shows_the_version_output(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    readme = (REPO / "README.md").read_text()
    *shown, installed = capsys.readouterr().out.splitlines()
    # the README shows 0.34.0 installed; the suite runs on either release
    assert installed == f"installed vLLM {INSTALLED_VLLM}"
    shown = "\n".join([*shown, "installed vLLM 0.34.0"])
    assert f"$ vllm-kimi-k3-moe --version\n{shown}\n```" in readme


# Imports humming as vLLM's MoE kernels do, after the tools' setting, with
# its build processes recorded instead of started; then asks humming's own
# launchers again with the variable unset (the probe sees a launch).
HUMMING_PROBE = """
import json, os, subprocess, sys
from vllm_kimi_k3_moe.tools.cli.common import no_background_kernel_builds

started, real = [], subprocess.Popen

class Recorded(real):
    def __init__(self, args, *rest, **kwargs):
        if "humming" not in " ".join(map(str, args)):
            return super().__init__(args, *rest, **kwargs)
        started.append(args[-1])

    def wait(self, timeout=None):
        return 0

subprocess.Popen = Recorded
if sys.argv[1] == "tools":
    no_background_kernel_builds()
import humming.ops.utils, humming.utils.nvrtc
at_import = list(started)
os.environ.pop("HUMMING_DISABLE_PARALLEL_BUILD", None)
humming.ops.utils.build_humming_launcher_in_bg()
humming.utils.nvrtc.build_nvrtc_compile_binary_in_bg()
print(json.dumps([at_import, started[len(at_import):]]))
"""


def test_the_tools_start_no_humming_build_processes() -> None:
    """humming starts its two background builds when imported unless
    HUMMING_DISABLE_PARALLEL_BUILD is "1"; the tools' setting stops both."""
    env = {k: v for k, v in os.environ.items() if k != HUMMING}
    result = subprocess.run(
        [sys.executable, "-c", HUMMING_PROBE, "tools"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
    )
    at_import, unset = json.loads(result.stdout.strip().splitlines()[-1])
    assert at_import == []
    assert len(unset) == 2  # the launcher and the NVRTC helper


@pytest.mark.parametrize(
    "argv", [["plan", "--tp", "7"], ["check", "/no/such/checkpoint"]]
)
def test_plan_and_check_turn_the_builds_off_in_their_process(
    monkeypatch, capsys, argv
) -> None:
    monkeypatch.delenv(HUMMING, raising=False)
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert os.environ[HUMMING] == "1"


def test_an_explicit_humming_setting_is_kept(monkeypatch, capsys) -> None:
    monkeypatch.setenv(HUMMING, "0")
    with pytest.raises(SystemExit):
        cli.main(["plan", "--tp", "7"])
    assert os.environ[HUMMING] == "0"


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("vllm serve /no/such/Kimi-K3 -tp 8", ["/no/such/Kimi-K3 does not exist"]),
        ("vllm serve -tp 8 --model=/no/such", ["/no/such does not exist"]),
        (
            "vllm serve moonshotai/Kimi-K3 -tp 8",
            ["nor in the Hugging Face cache", "hf download moonshotai/Kimi-K3"],
        ),
    ],
)
def test_a_serve_line_without_its_checkpoint_is_refused_before_vllm(
    line, words, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    status, out, imported, err = run_fresh_with_stderr("check", "--serve-command", line)
    assert (status, out, imported) == (2, "", [])
    assert len(err.splitlines()) == 1
    for word in words:
        assert word in err


def test_the_missing_checkpoint_line(capsys, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # empty
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", "--serve-command", "vllm serve moonshotai/Kimi-K3"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "vllm-kimi-k3-moe check: error: moonshotai/Kimi-K3 is neither a directory "
        f"nor in the Hugging Face cache ({tmp_path}); download it there with "
        "`hf download moonshotai/Kimi-K3` (where vllm serve then loads it from), "
        "or name your copy: `vllm-kimi-k3-moe check DIR --serve-command ...`"
    ]


def test_selftest_takes_names_in_any_case() -> None:
    args = cli.build_parser().parse_args(
        ["selftest", "--quantization", "FP8-Block", "--moe-backend", "Triton"]
    )
    assert args.quantization == "fp8-block"
