"""``vllm-kimi-k3-moe selftest`` on the visible GPU (``pytest -m gpu``; skipped
without CUDA): every published format with every ``--moe-backend`` it is
offered with, at TP16 and TP32, through the kernel vLLM selects on this GPU,
timed against vLLM alone's partition. A format or backend vLLM does not run
on this GPU at all (selftest's exit status 2, not even unsharded) is skipped
with vLLM's reason; any other outcome but "right" fails."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.tools import cli
from vllm_kimi_k3_moe.tools.cli.common import USAGE_ERROR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device: selftest's GPU path"
    ),
]

CASES = [(fmt.name, backend) for fmt in FORMATS for backend in fmt.moe_backends]


@pytest.mark.parametrize("tp_size", [16, 32])
@pytest.mark.parametrize(
    ("fmt", "backend"), CASES, ids=[f"{fmt}-{backend}" for fmt, backend in CASES]
)
def test_selftest_on_this_gpu(kimi_model, capsys, fmt, backend, tp_size) -> None:
    argv = ["selftest", "--tp", str(tp_size), "--quantization", fmt]
    try:
        status = cli.main([*argv, "--moe-backend", backend, "--json"])
    except SystemExit as exited:
        if exited.code == USAGE_ERROR:  # vLLM does not run it on this GPU
            pytest.skip(capsys.readouterr().err.strip())
        raise
    report = json.loads(capsys.readouterr().out)
    assert report["timed"], report
    assert status == 0, report["verdict"]
    assert all(time["plugin"] > 0 for time in report["times_us"].values()), report
