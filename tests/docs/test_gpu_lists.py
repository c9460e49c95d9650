"""The GPU lists of the README and docs/plan.md are ``plan --gpu``'s presets,
every one in their order, so a preset added (MI308X, MI350X) is not left
out of the guide; and the README stays a guide of at most 250 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_kimi_k3_moe.tools.deployment.gpus import ALL_GPU_PRESETS

ROOT = Path(__file__).resolve().parents[2]
LIST = re.compile(r"GPUs \(`--gpu`\):(.*?)(?:;|\(| or )", re.DOTALL)


@pytest.mark.parametrize("document", ["README.md", "docs/plan.md"])
def test_the_gpu_list_is_the_presets(document: str) -> None:
    text = (ROOT / document).read_text()
    found = LIST.search(text)
    assert found is not None, f"{document}: no 'GPUs (`--gpu`):' list"
    assert re.findall(r"`([a-z0-9]+)`", found.group(1)) == list(ALL_GPU_PRESETS)


def test_the_readme_is_at_most_250_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
