"""The tensor table of a safetensors checkpoint, read from its shard headers only.

Reads the shards vLLM's default loader reads: those named in
``model.safetensors.index.json``, or every ``*.safetensors`` file when there
is no index. Of each shard only the header is read (an 8-byte little-endian
length, then that many bytes of JSON), never tensor data: for a header set
the size of Kimi-K3's MXFP4 release (96 shards, ~1.5 TB) that is ~126 MB.
The JSON is decoded with msgspec (a vLLM dependency) into typed structs,
several times faster than ``json`` on ~500k entries. No torch, no vLLM import.
"""

from __future__ import annotations

import json
import operator
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

INDEX_FILE = "model.safetensors.index.json"
# safetensors refuses larger headers (SAFETENSORS_MAX_HEADER_SIZE)
MAX_HEADER_BYTES = 100_000_000
METADATA = "__metadata__"


class CheckpointDirError(ValueError):
    """A directory that holds no readable safetensors checkpoint; one line."""


class HeaderTensor(msgspec.Struct, gc=False):
    """One tensor as its shard header declares it."""

    dtype: str = ""
    shape: tuple[int, ...] = ()  # a tuple: compared with contracts as it is
    data_offsets: tuple[int, int] = (0, 0)

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


class _Index(msgspec.Struct):
    weight_map: dict[str, str]


# "__metadata__" decodes as a HeaderTensor too (its keys are not fields, so
# they are skipped) and is dropped.
_HEADER = msgspec.json.Decoder(dict[str, HeaderTensor])
_INDEX = msgspec.json.Decoder(_Index)
_END = operator.itemgetter(1)
_OFFSETS = operator.attrgetter("data_offsets")


@dataclass
class CheckpointTensors:
    """Every tensor the checkpoint's shards declare, and the shards that
    cannot be read as safetensors."""

    shards: list[str]  # every shard vLLM would load (the index's, or the glob's)
    # tensor name -> the shard the index puts it in ({} without an index)
    weight_map: dict[str, str] = field(default_factory=dict)
    # name -> the tensor, as the first shard (in name order) holding it has it
    tensors: dict[str, HeaderTensor] = field(default_factory=dict)
    # name -> the shard ``tensors[name]`` was read from
    shard_of: dict[str, str] = field(default_factory=dict)
    # name -> every shard holding it, for names held by more than one
    duplicates: dict[str, list[str]] = field(default_factory=dict)
    # shard -> why vLLM cannot load it (missing, truncated, bad header)
    broken_shards: dict[str, str] = field(default_factory=dict)
    # shard -> the tensors its header lists, for each header read
    tensors_in: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0  # the data every header read describes
    # of it, the bytes of ``tensors`` (a second copy of a name not counted)
    unique_bytes: int = 0

    @property
    def headers_read(self) -> int:
        """Shards whose header was read (not missing, parseable)."""
        return len(self.tensors_in)


def _shard_names(directory: Path) -> tuple[list[str], dict[str, str]]:
    """The shards vLLM loads, in name order (as its loader globs them), and
    the index's weight map (empty without an index)."""
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        names = sorted(p.name for p in directory.glob("*.safetensors"))
        if not names:
            raise CheckpointDirError(
                f"{directory} holds neither {INDEX_FILE} nor *.safetensors files"
            )
        return names, {}
    try:
        index = _INDEX.decode(index_path.read_bytes())
    except (OSError, msgspec.DecodeError) as error:
        raise CheckpointDirError(
            f"{index_path} is not a usable safetensors index: {error}"
        ) from None
    return sorted(set(index.weight_map.values())), index.weight_map


def _repeated_name(text: bytes) -> str | None:
    """The first name a header declares twice (decoding keeps only the last)."""
    seen: set[str] = set()
    for name, _ in json.loads(text, object_pairs_hook=lambda pairs: pairs):
        if name in seen:
            return name
        seen.add(name)
    return None


def read_header(path: Path) -> tuple[dict[str, HeaderTensor], int, int]:
    """A shard's tensors, the file size its header says it has, and the
    bytes of tensor data it describes."""
    with path.open("rb") as shard:
        prefix = shard.read(8)
        if len(prefix) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"declares a {length}-byte header")
        text = shard.read(length)
    if len(text) < length:
        raise ValueError(f"ends inside its {length}-byte header")
    tensors = _HEADER.decode(text)
    tensors.pop(METADATA, None)
    if text.count(b'"data_offsets"') != len(tensors):
        repeated = _repeated_name(text)
        raise ValueError(
            f"header declares {repeated!r} twice"
            if repeated
            else "header has an entry without data_offsets"
        )
    # safetensors lays the tensors out back to back from offset 0 (its
    # loader refuses gaps), so the data section ends at the largest end
    data = max(map(_END, map(_OFFSETS, tensors.values())), default=0)
    return tensors, 8 + length + data, data


def read_checkpoint_tensors(directory: Path) -> CheckpointTensors:
    """The tensor table of the safetensors checkpoint in ``directory``.

    Per shard, only C-level dict work (no Python loop over its tensors):
    half a million entries take a fraction of a second."""
    shards, weight_map = _shard_names(directory)
    checkpoint = CheckpointTensors(shards=shards, weight_map=weight_map)
    tensors, duplicates = checkpoint.tensors, checkpoint.duplicates
    for shard in checkpoint.shards:
        path = directory / shard
        try:
            header, needed, data = read_header(path)
            size = os.stat(path).st_size
        except FileNotFoundError:
            checkpoint.broken_shards[shard] = "is named in the index but missing"
            continue
        except (OSError, ValueError) as error:  # msgspec's errors are ValueErrors
            checkpoint.broken_shards[shard] = (
                f"is not a readable safetensors file: {error}"
            )
            continue
        checkpoint.tensors_in[shard] = len(header)
        if size != needed:
            checkpoint.broken_shards[shard] = (
                f"is {size} bytes, its header describes {needed} (truncated or "
                "incomplete download)"
            )
        checkpoint.total_bytes += data
        checkpoint.unique_bytes += data
        # The first shard (in name order) holding a name keeps it as the
        # checkpoint's tensor; the others are recorded as duplicates.
        for name in sorted(header.keys() & tensors.keys()):
            duplicates.setdefault(name, [checkpoint.shard_of[name]]).append(shard)
            checkpoint.unique_bytes -= header.pop(name).nbytes
        tensors.update(header)
        checkpoint.shard_of.update(dict.fromkeys(header, shard))
    return checkpoint
