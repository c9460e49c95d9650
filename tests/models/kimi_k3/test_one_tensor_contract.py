"""One tensor contract: what ``check`` refuses in a shard header, vLLM's
Kimi-K3 expert loader (with the plugin) refuses at load time.

Every routed-expert tensor of every published format, with a wrong shape
and with a wrong dtype: ``check`` names it with the shape or dtype expected
and found, and so does the strict loader of a real TP32 rank, before any
byte of the layer's parameters changes. One table
(``format_checkpoints.FORMAT_TENSORS``) writes the headers and the tensors.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.models.kimi_k3.format_checkpoints import (
    FORMAT_TENSORS,
    TORCH_DTYPES,
    write_format_checkpoint,
)
from tests.models.kimi_k3.kimi_k3_checkpoint import expert_tensor_name
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

HIDDEN, INTERMEDIATE = 256, 3072  # the tiny checkpoint's and layer's
LAYER = "model.layers.1.block_sparse_moe.experts"  # the layer's own prefix
BACKENDS = {
    "fp8-block": "triton",
    "nvfp4": "flashinfer_cutedsl",
    "modelopt-nvfp4": "flashinfer_cutedsl",
    "w4a16": "marlin",
    "awq": "marlin",
    "gptq": "marlin",
    "bf16": "triton",
}
PROJECTIONS = ("w1", "w3", "w2")


def stored_shape(fmt: str, suffix: str, projection: str) -> tuple[int, ...]:
    (shape,) = [s for name, s, _ in FORMAT_TENSORS[fmt] if name == suffix]
    rows, cols = (
        (HIDDEN, INTERMEDIATE) if projection == "w2" else (INTERMEDIATE, HIDDEN)
    )
    return tuple(shape(rows, cols))


def breach(fmt: str, kind: str, suffix: str, projection: str):
    """(shape, safetensors dtype) of the tensor with one thing wrong."""
    (dtype,) = [d for name, _, d in FORMAT_TENSORS[fmt] if name == suffix]
    shape = stored_shape(fmt, suffix, projection)
    if kind == "dtype":  # one no format stores this tensor in
        return shape, "BF16" if dtype in ("U8", "I32", "I64") else "I32"
    if len(shape) == 2:
        return (shape[0] // 2, shape[1]), dtype
    return (shape[0] + 1,) if shape else (1,), dtype


def cases(fmt: str) -> list[tuple[int, str, str, str]]:
    """(expert, projection, suffix, kind): every tensor, each way wrong, on
    distinct expert tensors (4 experts x 3 projections)."""
    wrongs = [
        (s, kind) for s, _, _ in FORMAT_TENSORS[fmt] for kind in ("shape", "dtype")
    ]
    return [
        (index // 3 % 4, PROJECTIONS[index % 3], suffix, kind)
        for index, (suffix, kind) in enumerate(wrongs)
    ]


def check_says(tmp_path, capsys, fmt: str) -> dict[tuple, str]:
    """check's problem line for each case, all in one checkpoint."""
    wrong = {
        expert_tensor_name(1, expert, projection, suffix): breach(
            fmt, kind, suffix, projection
        )
        for expert, projection, suffix, kind in cases(fmt)
    }

    def corrupt(entries):
        for index, (name, _, _) in enumerate(entries):
            if name in wrong:
                shape, dtype = wrong[name]
                entries[index] = (name, dtype, shape)

    write_format_checkpoint(tmp_path, fmt, edit=corrupt)
    assert main(["check", str(tmp_path), "--all"]) == 1
    out = capsys.readouterr().out
    said = {}
    for expert, projection, suffix, kind in cases(fmt):
        name = expert_tensor_name(1, expert, projection, suffix)
        match = re.search(rf"\n  {kind}: {re.escape(name)}: (.*)\n", out)
        assert match, f"{kind} of {name} not in:\n{out}"
        said[expert, projection, suffix, kind] = match.group(1)
    return said


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("fmt", FORMAT_TENSORS)
def test_the_loader_refuses_what_check_refuses(tmp_path, capsys, format_experts, fmt):
    said = check_says(tmp_path, capsys, fmt)
    experts = format_experts(fmt, BACKENDS[fmt], Topology(32), small=True, device="cpu")
    before = {name: as_bytes(p) for name, p in experts.named_parameters()}
    for expert, projection, suffix, kind in cases(fmt):
        shape, dtype = breach(fmt, kind, suffix, projection)
        tensor = torch.ones(shape).to(TORCH_DTYPES[dtype])
        stem = "w2" if projection == "w2" else "w13"
        param = experts.get_parameter(f"{stem}_{suffix}")
        with pytest.raises(ValueError) as refused:
            param.weight_loader(
                param,
                tensor,
                f"{LAYER}.{stem}_{suffix}",
                shard_id=projection,
                expert_id=expert,
            )
        message = str(refused.value)
        key = f"{LAYER}.{expert}.{projection}.{suffix}"
        assert message.startswith(f"Kimi-K3 checkpoint tensor {key} (expert "), message
        assert message.endswith("; nothing was written."), message
        checked = said[expert, projection, suffix, kind]
        found, expected = re.match(r"is (.*), expected (.*) \(in ", checked).groups()
        if kind == "dtype":  # the same names: safetensors'
            assert f"has dtype {found} ({tensor.dtype}), expected {expected}" in (
                message
            )
        else:  # the same shapes, check's as lists, the loader's as tuples
            assert found == str(list(shape))
            assert f"has shape {shape}, expected {tuple(json.loads(expected))} " in (
                message
            )
    for name, param in experts.named_parameters():
        assert torch.equal(as_bytes(param), before[name]), f"{name} was written"


def test_nvfp4_packed_weight_stored_as_bfloat16_is_refused_at_tp32(format_experts):
    """The right shape, the wrong dtype: copy_ would cast bfloat16 values
    into the packed FP4 bytes; the contract refuses it, nothing is written."""
    experts = format_experts(
        "nvfp4", "flashinfer_cutedsl", Topology(32), small=True, device="cpu"
    )
    param = experts.w13_weight_packed
    before = as_bytes(param)
    bf16 = torch.full((INTERMEDIATE, HIDDEN // 2), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as refused:
        param.weight_loader(
            param, bf16, f"{LAYER}.w13_weight_packed", shard_id="w1", expert_id=1
        )
    assert str(refused.value) == (
        f"Kimi-K3 checkpoint tensor {LAYER}.1.w1.weight_packed (expert 1, loaded "
        f"into {LAYER}.w13_weight_packed) has dtype BF16 (torch.bfloat16), "
        "expected U8 in NVFP4; nothing was written."
    )
    assert torch.equal(as_bytes(param), before)
