"""Asked again, ``plan`` answers from the plans it kept
(``tools.deployment.remembered``) without importing vLLM, byte for byte what
the full build printed; another question (config contents, arguments) is
worked out again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_kimi_k3_moe.tools.cli import build_parser, main
from vllm_kimi_k3_moe.tools.cli.plan import _plan_input, served_model
from vllm_kimi_k3_moe.tools.deployment.remembered import answer_key
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.plan.answers import Answers

# run in a new process: its output, and whether it imported vLLM or torch
ASKED_AGAIN = """
import sys
from vllm_kimi_k3_moe.tools.cli import main
status = main(sys.argv[1:])
imported = sorted({"vllm", "torch"} & set(sys.modules))
print(f"status {status}, imported {imported}", file=sys.stderr)
"""


def test_asked_again_prints_the_same_without_vllm(kimi_model, capsys):
    asked = ["plan", "--tp", "32", "--gpu", "h20", "--max-model-len", "10k"]
    # the next command starts from this environment, not from the one vLLM
    # leaves after building (vLLM 0.33.0 sets VLLM_USE_BREAKABLE_CUDAGRAPH)
    shell = dict(os.environ)
    assert main(asked) == 0
    fresh = capsys.readouterr()
    assert "importing vLLM" in fresh.err
    again = subprocess.run(
        [sys.executable, "-c", ASKED_AGAIN, *asked],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=shell,
    )
    assert "status 0, imported []" in again.stderr, again.stderr
    assert "importing vLLM" not in again.stderr
    assert again.stdout == fresh.out
    for kind in ("--json", "--wide"):  # rendered again from the same plans
        assert main([*asked, kind]) == 0
        assert "importing vLLM" not in capsys.readouterr().err


def _key(*arguments: str) -> str:
    args = build_parser().parse_args(["plan", "--gpu", "h20", *arguments])
    asked = _plan_input(args)
    answers = Answers(asked, served_model(args.model, args.config), args.gpus_per_node)
    return answer_key(answers._question("plan", asked.deployments))


@pytest.mark.parametrize(
    "other",
    [
        ["--max-model-len", "10k"],
        ["--kv-cache-dtype", "fp8"],
        ["--tp", "16"],
        ["--gpus-per-node", "4"],
        ["--model", "/models/kimi-k3"],
        ["--quantization", "w4a16"],
    ],
)
def test_another_argument_is_another_question(other):
    assert _key("--tp", "32") != _key("--tp", "32", *other)


def test_another_config_is_another_question(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"text_config": KIMI_K3_TEXT_CONFIG}))
    published = _key("--config", str(config))
    assert published == _key("--config", str(config))
    changed = {**KIMI_K3_TEXT_CONFIG, "rms_norm_eps": 1e-6}
    config.write_text(json.dumps({"text_config": changed}))
    assert _key("--config", str(config)) != published
