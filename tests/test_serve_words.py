"""A serve line's words as a shell splits them (no vLLM): a line continued
with ``\\`` over indented lines, as ``plan`` prints a long one, is one
line; and the checkpoint a model named by Hugging Face id stands for: the
copy ``hf download`` put in the Hugging Face cache."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from vllm_kimi_k3_moe.tools.check.hub_cache import checkpoint_directory
from vllm_kimi_k3_moe.tools.check.layout import PreflightInputError
from vllm_kimi_k3_moe.tools.check.serve_line import (
    ServeCommandError,
    serve_environment,
    serve_words,
)

CONTINUED = """\
      vllm serve '/models/Kimi K3' --tensor-parallel-size 32 \\
          --max-model-len 131072 \\
          --nnodes 4 --node-rank 0 --master-addr HEAD"""
WORDS = [
    "/models/Kimi K3",
    "--tensor-parallel-size",
    "32",
    "--max-model-len",
    "131072",
    "--nnodes",
    "4",
    "--node-rank",
    "0",
    "--master-addr",
    "HEAD",
]


def shell_words(command: str) -> list[str]:
    """What a POSIX shell passes ``vllm``, ``command`` being its line."""
    script = 'vllm() { for word in "$@"; do printf "%s\\0" "$word"; done; }\n'
    out = subprocess.run(
        ["sh", "-c", script + command], capture_output=True, text=True, check=True
    ).stdout
    return out.split("\0")[1:-1]  # after "serve"


def test_a_continued_line_is_one_line() -> None:
    assert serve_words(CONTINUED) == WORDS
    assert serve_words(CONTINUED.replace("\n", "\r\n")) == WORDS


@pytest.mark.parametrize(
    "command",
    [
        CONTINUED,
        # a backslash quoted, escaped, or before a newline between quotes
        'vllm serve \'a\\\nb\' "c\\\nd" e\\ f "g\\"h" \'i\\\' j\\\\',
        'vllm serve --speculative-config \'{"method": "mtp"}\' \\\n  -tp 8',
    ],
)
def test_the_words_are_the_shells(command: str) -> None:
    assert serve_words(command) == shell_words(command)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache: huggingface_hub's, where it looks."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def downloaded(cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """The snapshot ``hf download repo_id`` leaves: the repository's folder
    (named by huggingface_hub's own rule), ``refs/main`` naming the commit,
    its files under ``snapshots/<commit>``."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_is_its_cached_snapshot(hub_cache: Path) -> None:
    snapshot = downloaded(hub_cache, "moonshotai/Kimi-K3")
    assert checkpoint_directory("moonshotai/Kimi-K3") == snapshot


def test_a_hub_id_not_downloaded_says_what_works(hub_cache: Path) -> None:
    with pytest.raises(PreflightInputError) as refused:
        checkpoint_directory("moonshotai/Kimi-K3")
    message = str(refused.value)
    assert "\n" not in message
    assert str(hub_cache) in message
    assert "`hf download moonshotai/Kimi-K3`" in message
    assert "`vllm-kimi-k3-moe check DIR --serve-command ...`" in message


def test_a_directory_wins_over_the_cache(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloaded(hub_cache, "owner/model")
    (tmp_path / "owner" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert checkpoint_directory("owner/model") == Path("owner/model")


def test_a_path_that_is_no_hub_id_is_missing(hub_cache: Path) -> None:
    with pytest.raises(PreflightInputError, match="/no/such does not exist"):
        checkpoint_directory("/no/such")


def test_the_environment_before_vllm_serve_is_read_and_not_an_argument():
    """``plan`` prints ``VLLM_ROCM_USE_AITER=1 vllm serve ...`` on an AMD GPU
    where AITER is planned; a shell gives the server that variable."""
    line = f"VLLM_ROCM_USE_AITER=1 A='x y' {CONTINUED.strip()}"
    assert serve_words(line) == WORDS
    assert serve_environment(line) == {"VLLM_ROCM_USE_AITER": "1", "A": "x y"}
    assert serve_environment(CONTINUED) == {}
    with pytest.raises(ServeCommandError, match="NAME=VALUE"):
        serve_words("VLLM_ROCM_USE_AITER=1 python -m vllm serve x")
