"""Preflight of a Kimi-K3 checkpoint: will every routed expert land on every rank?

From ``config.json`` and the safetensors shard headers alone (no tensor
data, no torch, no vLLM), every routed-expert tensor vLLM's Kimi-K3 loader
maps is looked for: for each MoE layer (the MTP draft's included) and each
expert, the gate (w1), up (w3) and down (w2) projections' ``weight_packed``
and ``weight_scale``, present once, uint8, with the logical MXFP4 shape. The
topology must split the experts evenly. Everything wrong is collected, not
just the first thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.deployment import (
    DeploymentError,
    Parallelism,
    validate_backend,
    validate_parallelism,
)
from vllm_kimi_k3_moe.expert_tensor_layouts import PROJECTIONS, expert_tensor_shape
from vllm_kimi_k3_moe.kimi_k3_text_config import (
    ConfigFileError,
    main_moe_layers,
    mtp_moe_layers,
    read_config_document,
    text_config_fields,
)
from vllm_kimi_k3_moe.safetensors_headers import (
    CheckpointDirError,
    CheckpointTensors,
    read_checkpoint_tensors,
)

CONFIG_FILE = "config.json"
EXPERT_SUFFIXES = ("weight_packed", "weight_scale")
EXPERT_DTYPE = "U8"  # packed FP4 pairs and E8M0 scales are bytes
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
    quantization: str  # "mxfp4" (vLLM's rewrite of the release) or compressed-tensors
    quantization_format: str
    prefix: str

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

    def expert_tensors(self) -> dict[str, list[int]]:
        """Checkpoint name -> logical shape of every routed-expert tensor (a
        list, as shard headers give shapes)."""
        shapes = {
            (projection, suffix): list(
                expert_tensor_shape(projection, suffix, self.hidden, self.intermediate)
            )
            for projection in PROJECTIONS
            for suffix in EXPERT_SUFFIXES
        }
        return {
            f"{self.prefix}{layer}.block_sparse_moe.experts.{expert}."
            f"{projection}.{suffix}": shape
            for layer in self.layers
            for expert in range(self.num_experts)
            for (projection, suffix), shape in shapes.items()
        }


def _mxfp4_path(quantization_config: Any, config_path: Path) -> tuple[str, str]:
    """(vLLM quantization path, checkpoint format) of an MXFP4 checkpoint."""
    if not isinstance(quantization_config, dict):
        raise PreflightInputError(
            f"{config_path} has no quantization_config: check verifies MXFP4 "
            "checkpoints (compressed-tensors, as Kimi-K3 is released)"
        )
    method = quantization_config.get("quant_method")
    checkpoint_format = quantization_config.get("format")
    if method != "compressed-tensors":
        raise PreflightInputError(
            f"{config_path}: quantization_config.quant_method is {method!r}; "
            "check verifies compressed-tensors MXFP4 checkpoints, as Kimi-K3 "
            "is released"
        )
    if checkpoint_format == "mxfp4-pack-quantized":
        return "mxfp4", checkpoint_format  # vLLM rewrites it to native MXFP4
    groups = quantization_config.get("config_groups") or {}
    for group in groups.values() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and (
            weights.get("num_bits"),
            weights.get("type"),
            weights.get("group_size"),
        ) == (4, "float", 32):
            return "compressed-tensors", str(checkpoint_format)
    raise PreflightInputError(
        f"{config_path}: the compressed-tensors config has no MXFP4 weights "
        "(4-bit float in groups of 32)"
    )


def read_layout(directory: Path) -> KimiK3Layout:
    """The expert layout promised by ``directory``'s ``config.json``."""
    config_path = directory / CONFIG_FILE
    try:
        document = read_config_document(config_path)
        text_config = text_config_fields(document, config_path)
    except ConfigFileError as error:
        raise PreflightInputError(str(error)) from None
    nested = document.get("text_config")
    quantization_config = document.get("quantization_config")
    if quantization_config is None and isinstance(nested, dict):
        quantization_config = nested.get("quantization_config")
    quantization, checkpoint_format = _mxfp4_path(quantization_config, config_path)
    return KimiK3Layout(
        text_config=text_config,
        quantization=quantization,
        quantization_format=checkpoint_format,
        prefix=MULTIMODAL_PREFIX if nested is not None else TEXT_ONLY_PREFIX,
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
    parallelism: Parallelism
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
    expected: dict[str, list[int]],
    checkpoint: CheckpointTensors,
) -> None:
    problems = report.problems
    tensors, duplicates = checkpoint.tensors, checkpoint.duplicates
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            problems.append(
                Problem("missing", name, f"expected {_shape(shape)} {EXPERT_DTYPE}")
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
        if tensor.dtype != EXPERT_DTYPE:
            problems.append(
                Problem(
                    "dtype",
                    name,
                    f"is {tensor.dtype}, expected {EXPERT_DTYPE} (in {tensor.shard})",
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
                    "weight_packed/weight_scale under "
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
    directory: Path, parallelism: Parallelism, backend: str | None = None
) -> PreflightReport:
    """Check ``directory``'s routed experts for ``parallelism`` (and that
    ``backend``, if named, is an MoE kernel of the checkpoint's path)."""
    if not directory.is_dir():
        raise PreflightInputError(f"checkpoint directory {directory} does not exist")
    layout = read_layout(directory)
    if backend is not None:
        try:
            validate_backend(layout.quantization, backend)
        except DeploymentError as error:
            raise PreflightInputError(str(error)) from None
    try:
        checkpoint = read_checkpoint_tensors(directory)
    except CheckpointDirError as error:
        raise PreflightInputError(str(error)) from None
    report = PreflightReport(directory, layout, parallelism)
    try:
        validate_parallelism(layout.text_config, parallelism)
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
