"""Preflight of a Kimi-K3 checkpoint: will every routed expert land on every rank?

From ``config.json`` and the safetensors shard headers alone (no tensor
data, no torch, no vLLM), every routed-expert tensor vLLM's Kimi-K3 loader
maps is looked for: for each MoE layer (the MTP draft's included) and each
expert, the gate (w1), up (w3) and down (w2) projections' tensors in the
checkpoint's format (``vllm_kimi_k3_moe.formats``), each present once, with the
dtype and logical shape of that format. The topology must split the experts
evenly. Everything wrong is collected, not just the first thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.formats import CheckpointFormat, FormatError, recognise
from vllm_kimi_k3_moe.tools.check.safetensors_headers import (
    CheckpointDirError,
    CheckpointTensors,
    read_checkpoint_tensors,
)
from vllm_kimi_k3_moe.tools.text_config import (
    ConfigFileError,
    language_model_fields,
    main_moe_layers,
    mtp_moe_layers,
    read_config_document,
    text_config_fields,
)
from vllm_kimi_k3_moe.tools.topology import (
    DeploymentError,
    Topology,
    validate_backend,
    validate_topology,
)

CONFIG_FILE = "config.json"
MODELOPT_CONFIG_FILE = "hf_quant_config.json"
# vLLM's Kimi-K3 models load text weights from these checkpoint prefixes: the
# multimodal checkpoint (config nests text_config) and a text-only one.
MULTIMODAL_PREFIX = "language_model.layers."
TEXT_ONLY_PREFIX = "model.layers."
_ANY_EXPERT_TENSOR = re.compile(r"layers\.\d+\.block_sparse_moe\.experts\.\d+\.")


class PreflightInputError(ValueError):
    """Input the preflight cannot work on; the message is one line."""


@dataclass(frozen=True)
class Problem:
    """One thing that would break or corrupt loading, about one subject (a
    tensor, a shard or the topology)."""

    kind: str  # missing, shape, dtype, duplicate, unexpected, shard, topology
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.subject}: {self.detail}"


@dataclass(frozen=True)
class KimiK3Layout:
    """The routed experts a Kimi-K3 config promises."""

    text_config: dict[str, Any]
    format: CheckpointFormat
    prefix: str
    # the whole language model's config, read only when asked (--moe-backend)
    language_model: dict[str, Any] | None = None

    @property
    def hidden(self) -> int:
        routed = self.text_config.get("routed_expert_hidden_size")
        return routed or self.text_config["hidden_size"]

    @property
    def intermediate(self) -> int:
        return self.text_config["moe_intermediate_size"]

    @property
    def num_experts(self) -> int:
        return self.text_config["num_experts"]

    @property
    def main_layers(self) -> list[int]:
        return main_moe_layers(self.text_config)

    @property
    def mtp_layers(self) -> list[int]:
        return mtp_moe_layers(self.text_config)

    @property
    def layers(self) -> list[int]:
        """Every MoE layer whose experts the checkpoint holds."""
        return [*self.main_layers, *self.mtp_layers]

    def expert_tensors(self) -> dict[str, tuple[list[int], tuple[str, ...]]]:
        """Checkpoint name -> (logical shape, a list as shard headers give
        shapes; the dtypes it may have) of every routed-expert tensor."""
        per_projection = {
            key: (list(shape), dtypes)
            for key, (shape, dtypes) in self.format.tensors.expected(
                self.hidden, self.intermediate
            ).items()
        }
        return {
            f"{self.prefix}{layer}.block_sparse_moe.experts.{expert}."
            f"{projection}.{suffix}": expected
            for layer in self.layers
            for expert in range(self.num_experts)
            for (projection, suffix), expected in per_projection.items()
        }


def read_layout(directory: Path, language_model: bool = False) -> KimiK3Layout:
    """The expert layout promised by ``directory``'s ``config.json`` (and,
    if asked, the whole language model's config, for building it)."""
    config_path = directory / CONFIG_FILE
    try:
        document = read_config_document(config_path)
        text_config = text_config_fields(document, config_path)
        whole = language_model_fields(document, config_path) if language_model else None
    except ConfigFileError as error:
        raise PreflightInputError(str(error)) from None
    nested = document.get("text_config")
    quantization_config = document.get("quantization_config")
    if quantization_config is None and isinstance(nested, dict):
        quantization_config = nested.get("quantization_config")
    hf_quant_config = None
    if (directory / MODELOPT_CONFIG_FILE).is_file():
        try:
            hf_quant_config = read_config_document(directory / MODELOPT_CONFIG_FILE)
        except ConfigFileError as error:
            raise PreflightInputError(str(error)) from None
    try:
        fmt = recognise(quantization_config, hf_quant_config, str(config_path))
    except FormatError as error:
        raise PreflightInputError(str(error)) from None
    return KimiK3Layout(
        text_config=text_config,
        format=fmt,
        prefix=MULTIMODAL_PREFIX if nested is not None else TEXT_ONLY_PREFIX,
        language_model=whole,
    )


@dataclass(frozen=True)
class RankShare:
    """The part of the routed experts each GPU loads, at the logical size."""

    expert_parallel: bool
    experts: int
    intermediate: int
    expert_bytes: int


@dataclass
class PreflightReport:
    directory: Path
    layout: KimiK3Layout
    parallelism: Topology
    shards: int = 0
    total_bytes: int = 0
    expert_bytes: int = 0
    expert_tensors_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def share(self) -> RankShare | None:
        """Each GPU's share, or None when the topology does not divide."""
        if any(p.kind == "topology" for p in self.problems):
            return None
        parallelism = self.parallelism
        return RankShare(
            expert_parallel=parallelism.expert_parallel,
            experts=parallelism.experts_per_gpu(self.layout.num_experts),
            intermediate=parallelism.intermediate_per_gpu(self.layout.intermediate),
            expert_bytes=self.expert_bytes // parallelism.gpus,
        )


def _shape(shape: list[int]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _compare(
    report: PreflightReport,
    expected: dict[str, tuple[list[int], tuple[str, ...]]],
    checkpoint: CheckpointTensors,
) -> None:
    problems = report.problems
    tensors, duplicates = checkpoint.tensors, checkpoint.duplicates
    for name, (shape, dtypes) in expected.items():
        tensor = tensors.get(name)
        dtype_text = " or ".join(dtypes)
        if tensor is None:
            problems.append(
                Problem("missing", name, f"expected {_shape(shape)} {dtype_text}")
            )
            continue
        report.expert_tensors_checked += 1
        report.expert_bytes += tensor.nbytes
        if name in duplicates:
            shards = " and ".join(duplicates[name])
            problems.append(
                Problem("duplicate", name, f"in {shards}; vLLM would load it twice")
            )
        if tensor.shape != shape:
            problems.append(
                Problem(
                    "shape",
                    name,
                    f"is {_shape(tensor.shape)}, expected {_shape(shape)} "
                    f"(in {tensor.shard})",
                )
            )
        if dtypes and tensor.dtype not in dtypes:
            problems.append(
                Problem(
                    "dtype",
                    name,
                    f"is {tensor.dtype}, expected {dtype_text} (in {tensor.shard})",
                )
            )
    for name in sorted(checkpoint.tensors.keys() - expected.keys()):
        if _ANY_EXPERT_TENSOR.search(name):
            problems.append(
                Problem(
                    "unexpected",
                    name,
                    "looks like a routed-expert tensor but is not one of "
                    f"layers {layer_ranges(report.layout.layers)} x experts 0-"
                    f"{report.layout.num_experts - 1} x w1/w2/w3 x "
                    f"{'/'.join(report.layout.format.tensors.suffixes)} under "
                    f"{report.layout.prefix}; vLLM's Kimi-K3 loader has no "
                    "parameter for it",
                )
            )


def layer_ranges(layers: list[int]) -> str:
    """``[1, 2, ..., 92]`` as "1-92"; anything else listed."""
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers)) or "none"


def preflight(
    directory: Path, parallelism: Topology, backend: str | None = None
) -> PreflightReport:
    """Check ``directory``'s routed experts for ``parallelism`` (and that
    ``backend``, if named, is an MoE kernel of the checkpoint's path)."""
    if not directory.is_dir():
        raise PreflightInputError(f"checkpoint directory {directory} does not exist")
    layout = read_layout(directory, language_model=backend is not None)
    if backend is not None:
        try:
            validate_backend(layout.format.format.name, backend)
        except DeploymentError as error:
            raise PreflightInputError(str(error)) from None
    try:
        checkpoint = read_checkpoint_tensors(directory)
    except CheckpointDirError as error:
        raise PreflightInputError(str(error)) from None
    report = PreflightReport(directory, layout, parallelism)
    try:
        validate_topology(layout.text_config, parallelism, layout.format.format)
    except DeploymentError as error:
        report.problems.append(
            Problem("topology", parallelism.label("subject"), str(error))
        )
    report.shards = len(checkpoint.shards)
    report.total_bytes = checkpoint.total_bytes
    for shard, reason in checkpoint.broken_shards.items():
        report.problems.append(Problem("shard", shard, reason))
    _compare(report, layout.expert_tensors(), checkpoint)
    return report
