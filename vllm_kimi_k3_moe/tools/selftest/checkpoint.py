"""The routed-expert tensors the selftest fills every rank from: one MoE
layer's, of the first ``MoeShape.experts`` experts, read from a checkpoint
directory (a real one, or ``synthetic``'s) and nothing else.

vLLM's default loader reads every tensor of every shard it opens; a
released Kimi-K3 is ~1.5 TB. Here the index says which shard holds each
wanted tensor, and safetensors (the library vLLM's loader reads shards
with) reads exactly those. What happens to them next is vLLM's loader
(``layer.load_experts``). They are renamed to the harness's layer
(``LAYER``) under the multimodal prefix vLLM's Kimi-K3 mapper expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from vllm_kimi_k3_moe.formats import CheckpointFormat
from vllm_kimi_k3_moe.formats.safetensors_headers import (
    INDEX_FILE,
    CheckpointDirError,
    read_checkpoint_tensors,
    read_header,
)
from vllm_kimi_k3_moe.tools.check.layout import (
    MODELOPT_CONFIG_FILE,
    MULTIMODAL_PREFIX,
    KimiK3Layout,
    PreflightInputError,
    read_layout,
)
from vllm_kimi_k3_moe.tools.selftest.shape import MoeShape

if TYPE_CHECKING:
    from torch import Tensor

# The harness's MoE layer: layer 0 is the dense layer (not built), 1 the MoE.
LAYER = 1
# Bytes read at a time when looking for data in the layer's tensors.
CHUNK_BYTES = 1 << 24


class CheckpointInputError(ValueError):
    """A checkpoint the selftest cannot read its experts from; one line."""


def expert_key(expert: int, projection: str, suffix: str) -> str:
    """A routed-expert tensor's checkpoint key, in the harness's layer."""
    return (
        f"{MULTIMODAL_PREFIX}{LAYER}.block_sparse_moe.experts.{expert}."
        f"{projection}.{suffix}"
    )


def expert_keys(fmt: CheckpointFormat, shape: MoeShape) -> list[str]:
    """Every checkpoint key of the layer's experts, expert by expert, in the
    format's checkpoint order (w1, w3, w2; sharded tensors first)."""
    contracts = fmt.tensors.contracts(shape.width, shape.intermediate)
    return [
        expert_key(expert, projection, suffix)
        for expert in range(shape.experts)
        for projection, suffix in contracts
    ]


@dataclass(frozen=True)
class ExpertCheckpoint:
    """A checkpoint directory the experts are read from, with what its
    ``config.json`` says."""

    directory: Path
    layout: KimiK3Layout  # format, text config, key prefix
    layer: int  # the first MoE layer: the one read
    quantization_config: dict[str, Any] | None  # as config.json has it
    hf_quant_config: dict[str, Any] | None  # ModelOpt's hf_quant_config.json

    def key_in_checkpoint(self, key: str) -> str:
        """``key`` (``expert_key``) as the checkpoint names it."""
        harness = f"{MULTIMODAL_PREFIX}{LAYER}."
        return f"{self.layout.prefix}{self.layer}." + key.removeprefix(harness)


def open_checkpoint(directory: Path) -> ExpertCheckpoint:
    """Read ``directory``'s ``config.json`` (and ModelOpt's file): the
    format, as ``check`` recognises it, and the first MoE layer. No tensor
    is read; ``CheckpointInputError`` in one line if it is no checkpoint."""
    if not directory.is_dir():
        raise CheckpointInputError(f"checkpoint {directory} is not a directory")
    try:
        layout = read_layout(directory)
    except PreflightInputError as error:
        raise CheckpointInputError(str(error)) from None
    if not layout.main_layers:
        raise CheckpointInputError(f"{directory}/config.json declares no MoE layer")
    document = json.loads((directory / "config.json").read_text())
    quantization = document.get("quantization_config")
    if quantization is None and isinstance(document.get("text_config"), dict):
        quantization = document["text_config"].get("quantization_config")
    modelopt = directory / MODELOPT_CONFIG_FILE
    return ExpertCheckpoint(
        directory=directory,
        layout=layout,
        layer=layout.main_layers[0],
        quantization_config=quantization,
        hf_quant_config=json.loads(modelopt.read_text())
        if modelopt.is_file()
        else None,
    )


def shard_of_each(checkpoint: ExpertCheckpoint, keys: list[str]) -> dict[str, Path]:
    """Which shard holds each of ``keys``: from the index (or, without one,
    the shard headers), refusing in one line a key the checkpoint lacks."""
    directory = checkpoint.directory
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        weight_map = index.get("weight_map") or {}
    else:
        try:
            weight_map = read_checkpoint_tensors(directory).shard_of
        except CheckpointDirError as error:
            raise CheckpointInputError(str(error)) from None
    shards = {}
    for key in keys:
        stored = checkpoint.key_in_checkpoint(key)
        if stored not in weight_map:
            raise CheckpointInputError(
                f"{directory} has no {stored}; run vllm-kimi-k3-moe check on it"
            )
        shards[key] = directory / weight_map[stored]
    return shards


def read_experts(
    checkpoint: ExpertCheckpoint, fmt: CheckpointFormat, shape: MoeShape
) -> dict[str, Tensor]:
    """The layer's expert tensors (``expert_keys``), read one by one from the
    shards that hold them, by the harness's keys."""
    shards = shard_of_each(checkpoint, expert_keys(fmt, shape))
    tensors: dict[str, Tensor] = {}
    for shard in sorted(set(shards.values())):
        with safe_open(shard, framework="pt") as opened:
            for key, holder in shards.items():
                if holder == shard:
                    tensors[key] = opened.get_tensor(checkpoint.key_in_checkpoint(key))
    return {key: tensors[key] for key in shards}


def zero_data_refusal(checkpoint: ExpertCheckpoint) -> str:
    """Why a layer whose expert data is all zero cannot judge a layout."""
    return (
        f"the routed experts of layer {checkpoint.layer} of {checkpoint.directory} "
        "give an all-zero output (their data is zero: a header-only or sparse "
        "copy?): a layout cannot be judged on them"
    )


def expert_data_is_zero(
    checkpoint: ExpertCheckpoint, fmt: CheckpointFormat, shape: MoeShape
) -> bool:
    """Whether every byte of the layer's expert tensors (``expert_keys``) is
    zero, as a header-only or sparse copy of a checkpoint reads: in every
    format the weights are then zero (zero values, or zero scales), and so
    is the output of every layout. Read in chunks from the shards, without
    torch; stops at the first byte that is not zero."""
    shards = shard_of_each(checkpoint, expert_keys(fmt, shape))
    for shard in sorted(set(shards.values())):
        tensors, size, data = read_header(shard)
        start = size - data  # the data section follows the header
        with shard.open("rb") as opened:
            for key, holder in shards.items():
                if holder != shard:
                    continue
                begin, end = tensors[checkpoint.key_in_checkpoint(key)].data_offsets
                opened.seek(start + begin)
                remaining = end - begin
                while remaining:
                    chunk = opened.read(min(CHUNK_BYTES, remaining))
                    if not chunk:
                        break  # a truncated shard: safetensors says so later
                    if chunk.count(0) != len(chunk):
                        return False
                    remaining -= len(chunk)
    return True
