"""What ``plan`` prints, ``check`` takes: the ``vllm serve`` lines plan
prints for TP32 on H20s (four nodes of eight), pasted as printed (text:
indented, continued with ``\\`` over lines; ``--json``: one string per
node), each pass ``check --serve-command`` on the release's header set
(``benchmarks.header_set``), the head node's and a headless node's alike;
and with plan's default model, the Hugging Face id, check reads the copy
``hf download`` left in the Hugging Face cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from benchmarks.header_set import write as write_header_set
from tests.shared_planners import shared_planners
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.gpus import planned_for
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment
from vllm_kimi_k3_moe.tools.plan.report import as_json, serve_commands
from vllm_kimi_k3_moe.tools.plan.serve_command import DEFAULT_MODEL

TP32 = Deployment(32)


@pytest.fixture(scope="module")
def header_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's config.json, index and shard headers (no data)."""
    directory = tmp_path_factory.mktemp("release-header-set")
    write_header_set(directory)
    return directory


def printed_plan(planner, model: str, monkeypatch) -> object:
    """plan --gpu h20 --tp 32 --model MODEL, from the suite's H20 planner
    (its builds shared; the model names nothing else than the lines')."""
    monkeypatch.setattr(planner, "model", model)
    return planner.plan(TP32)


def node_blocks(text: str) -> dict[str, str]:
    """Each node's line as printed under its ``node N:`` heading, its
    indentation and ``\\`` line breaks kept."""
    blocks: dict[str, list[str]] = {}
    node = None
    for line in text.splitlines():
        heading = line.strip()
        if heading.startswith("node") and heading.endswith(":"):
            node = heading.removesuffix(":")
            blocks[node] = []
        elif heading.startswith("nodes "):
            node = None
        elif node is not None:
            blocks[node].append(line)
    return {node: "\n".join(lines) for node, lines in blocks.items()}


def check_status(capsys, *args: str) -> int:
    status = main(["check", *args])
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("OK "), out
    return status


def test_plans_printed_lines_pass_check(
    kimi_k3_h20_planner, header_set, capsys, monkeypatch
) -> None:
    plan = printed_plan(kimi_k3_h20_planner, str(header_set), monkeypatch)
    blocks = node_blocks(serve_commands([plan]))
    assert list(blocks) == ["node 0", "node 1"]
    assert all(" \\\n" in block for block in blocks.values())
    (document,) = json.loads(as_json([plan], planned_for("h20", None, (9, 0))))
    assert len(document["serve_commands"]) == 4  # 4 nodes of 8 GPUs
    with shared_planners(monkeypatch):  # every line sizes the same TP32
        for pasted in [*blocks.values(), *document["serve_commands"]]:
            assert check_status(capsys, "--serve-command", pasted) == 0


def test_plans_default_model_is_read_from_the_hugging_face_cache(
    kimi_k3_h20_planner, header_set, tmp_path, capsys, monkeypatch
) -> None:
    """``hf download moonshotai/Kimi-K3`` keeps the files under
    ``snapshots/<commit>`` of the repository's folder, ``refs/main`` naming
    the commit: here that snapshot is the header set."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / repo_folder_name(repo_id=DEFAULT_MODEL, repo_type="model")
    commit = "1" * 40
    (repo / "snapshots").mkdir(parents=True)
    (repo / "snapshots" / commit).symlink_to(header_set)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    plan = printed_plan(kimi_k3_h20_planner, DEFAULT_MODEL, monkeypatch)
    head = node_blocks(serve_commands([plan]))["node 0"]
    assert DEFAULT_MODEL in head
    assert check_status(capsys, "--serve-command", head) == 0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # a flag vLLM's parser does not know, on a continued line
        (("--max-model-len", "--max-model-length"), "--max-model-length 131072"),
        (("--tensor-parallel-size 32", "--tensor-parallel-size x"), "'x'"),
    ],
)
def test_a_wrong_printed_line_is_refused_with_its_reason(
    header_set, capsys, change, reason
) -> None:
    line = (
        f"      vllm serve {header_set} --tensor-parallel-size 32 \\\n"
        "          --max-model-len 131072 \\\n"
        "          --nnodes 4 --node-rank 0 --master-addr HEAD"
    )
    with pytest.raises(SystemExit) as exited:
        main(["check", "--serve-command", line.replace(*change)])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("vllm-kimi-k3-moe check: error: vllm serve's parser: ")
    assert reason in error
