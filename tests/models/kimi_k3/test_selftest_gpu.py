"""``vllm-kimi-k3-moe selftest`` on the visible GPU (``pytest -m gpu``): every
published format with every ``--moe-backend`` it is offered with, at TP16 and
TP32, through the kernel vLLM selects on this GPU inside vLLM's forward
context, the experts timed alone in a CUDA graph against vLLM alone's
partition. Skipped only with a reason naming what is missing: a CUDA device,
vLLM's compiled CUDA ops, or (selftest's exit status 2) the kernel for the
format on this GPU, in vLLM's words. Any other outcome but "right" fails."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from vllm_kimi_k3_moe.formats import FORMATS
from vllm_kimi_k3_moe.tools import cli
from vllm_kimi_k3_moe.tools.cli.common import USAGE_ERROR


def _missing() -> str | None:
    """What this machine lacks for selftest's GPU path, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("vllm._C") is None:
        return "vLLM's compiled CUDA ops (vllm._C) are not installed"
    return None


MISSING = _missing()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(MISSING is not None, reason=f"selftest on a GPU: {MISSING}"),
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
            gpu = torch.cuda.get_device_name()
            pytest.skip(f"{gpu}: {capsys.readouterr().err.strip()}")
        raise
    report = json.loads(capsys.readouterr().out)
    assert report["timed"], report
    assert status == 0, report["verdict"]
    for tokens, time in report["times_us"].items():
        assert time["plugin_eager"] > 0, (tokens, time)
        # vLLM replays its decode batches from CUDA graphs: so must the experts
        assert time["plugin"] is not None and time["plugin"] > 0, (tokens, time)
