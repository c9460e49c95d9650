"""Preflight of a Kimi-K3 checkpoint: will every routed expert land on every rank?

From ``config.json`` and the safetensors shard headers alone (no tensor
data, no torch, no vLLM), every routed-expert tensor vLLM's Kimi-K3 loader
maps is looked for: for each MoE layer (the MTP draft's included) and each
expert, the gate (w1), up (w3) and down (w2) projections' tensors in the
checkpoint's format (``vllm_kimi_k3_moe.formats``), each present once and
fitting its tensor contract (dtype and logical shape): the contract the
strict expert loader holds each tensor to at load time. Everything wrong is
collected (``problems.ProblemLog``), not just the first thing.

Unusable input ends the preflight before any shard is read: a path that is
not a checkpoint directory, a config or format it cannot use, or a topology
vLLM cannot build (``topology.validate_topology``, the rules ``plan``
applies, with the same message).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kimi_k3_moe.formats import published_checkpoint_formats
from vllm_kimi_k3_moe.formats.adapters import ADAPTERS
from vllm_kimi_k3_moe.formats.bf16 import BF16, TENSORS
from vllm_kimi_k3_moe.formats.layouts import TensorContract
from vllm_kimi_k3_moe.formats.record import CheckpointFormat
from vllm_kimi_k3_moe.formats.safetensors_headers import (
    CheckpointDirError,
    CheckpointTensors,
    HeaderTensor,
    read_checkpoint_tensors,
)
from vllm_kimi_k3_moe.tools.check.layout import (
    KimiK3Layout,
    PreflightInputError,
    layer_ranges,
    read_layout,
)
from vllm_kimi_k3_moe.tools.check.lookalike import mismatch
from vllm_kimi_k3_moe.tools.check.problems import ProblemLog
from vllm_kimi_k3_moe.tools.check.pruned_layers import (
    PRUNED_PER_LAYER_FIX,
    pruned_per_layer,
)
from vllm_kimi_k3_moe.tools.check.sharding import (
    GpuShare,
    StageShare,
    gpu_shares,
    stage_shares,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    DeploymentError,
    Topology,
    validate_backend,
)
from vllm_kimi_k3_moe.tools.deployment.tp_sizes import validate_with_working_tp_sizes

__all__ = [
    "PreflightInputError",
    "PreflightReport",
    "preflight",
    "refuse_a_missing_directory",
]

# How unquantized adapters are stored, among the ways ``check`` knows.
BF16_FORMAT = CheckpointFormat(BF16, "BF16", TENSORS)
_ANY_EXPERT_TENSOR = re.compile(r"layers\.\d+\.block_sparse_moe\.experts\.\d+\.")


@dataclass
class PreflightReport:
    directory: Path
    layout: KimiK3Layout
    parallelism: Topology
    shards: int = 0  # in the checkpoint (the index's, or the glob's)
    headers_read: int = 0
    total_bytes: int = 0
    expert_bytes: int = 0
    expert_tensors_found: int = 0
    adapter_tensors_found: int = 0
    problems: ProblemLog = field(default_factory=ProblemLog)
    # the cause, when the expert tensors are in another format than declared
    # or the layers hold different expert counts, and what fixes it (None:
    # the default of each)
    mismatch: str | None = None
    fix: str | None = None

    @property
    def expert_tensors_expected(self) -> int:
        return self.layout.expected_tensors

    @property
    def adapter_tensors_expected(self) -> int:
        return len(self.layout.layers) * len(self.layout.adapter_contracts())

    @property
    def shares(self) -> list[GpuShare]:
        """What each GPU of the MoE group loads."""
        return gpu_shares(self.layout, self.parallelism, self.expert_bytes)

    @property
    def stages(self) -> list[StageShare]:
        """What each GPU of each pipeline stage's MoE group loads."""
        return stage_shares(self.layout, self.parallelism, self.expert_bytes)

    @property
    def status(self) -> int:
        """The command's exit status: 0 clean, 1 problems found."""
        return 1 if self.problems else 0


def _shape(shape: tuple[int, ...]) -> str:
    return f"[{', '.join(map(str, shape))}]"


@dataclass
class _UnreadShard:
    """The expert tensors the index puts in a shard that could not be read."""

    tensors: int = 0
    layers: set[int] = field(default_factory=set)


def _compare(report: PreflightReport, checkpoint: CheckpointTensors) -> None:
    """The one pass over the expected expert tensors: each looked up (and
    taken out of a copy of the table, so what is left over needs no second
    pass), held to its contract, and every problem logged as found."""
    layout, log = report.layout, report.problems
    contracts = layout.contracts()
    weight_map, shard_of = checkpoint.weight_map, checkpoint.shard_of
    # Shards whose header was never read: their tensors are one problem.
    unread = {
        shard: _UnreadShard()
        for shard in checkpoint.broken_shards
        if shard not in checkpoint.tensors_in
    }
    remaining = dict(checkpoint.tensors)
    take = remaining.pop
    missing = 0
    for layer in layout.layers:
        for expert in range(layout.num_experts):
            base = layout.expert_prefix(layer, expert)
            for key, contract in contracts:
                name = base + key
                tensor = take(name, None)
                if tensor is None:
                    missing += 1
                    shard = weight_map.get(name)
                    if shard in unread:
                        unread[shard].tensors += 1
                        unread[shard].layers.add(layer)
                        continue
                    log.add(
                        "missing",
                        name,
                        f"expected {_shape(contract.shape)} {contract.dtype_text}",
                        shard,
                    )
                elif not contract.fits(tensor.shape, tensor.dtype):
                    _log_breaches(log, name, contract, tensor, shard_of[name])
    report.expert_tensors_found = layout.expected_tensors - missing
    report.expert_bytes = checkpoint.unique_bytes - sum(
        tensor.nbytes for tensor in remaining.values()
    )
    _log_shards(report, checkpoint, unread)
    for name, shards in checkpoint.duplicates.items():
        if name not in remaining:  # an expected expert tensor
            log.add(
                "duplicate",
                name,
                f"in {' and '.join(shards)}; vLLM would load it twice",
                shards[-1],
            )
    _log_unexpected(report, remaining, shard_of)


def _log_breaches(
    log: ProblemLog,
    name: str,
    contract: TensorContract,
    tensor: HeaderTensor,
    shard: str,
    why: str = "",
) -> None:
    """One problem per way ``tensor`` breaks its contract."""
    for breach in contract.breaches(tensor.shape, tensor.dtype):
        found, expected = breach.found, breach.expected
        if breach.kind == "shape":
            found, expected = _shape(found), _shape(expected)
        detail = f"is {found}, expected {expected}{why} (in {shard})"
        log.add(breach.kind, name, detail, shard)


def _compare_adapters(report: PreflightReport, checkpoint: CheckpointTensors) -> None:
    """Every MoE layer's latent adapters held to their contracts, as the
    experts are (quantized as they are where the config quantizes them,
    else BF16); a tensor of theirs the contracts do not name, as the other
    way of storing them leaves, is unexpected."""
    layout, log = report.layout, report.problems
    contracts = dict(layout.adapter_contracts())
    if not contracts:
        return
    known = {
        f"{adapter}.{suffix}"
        for adapter in ADAPTERS
        for fmt in (*published_checkpoint_formats(), BF16_FORMAT)
        for suffix in fmt.tensors.suffixes
    }
    how = (
        f"quantized as its experts ({layout.declared_in} quantizes the adapters)"
        if layout.adapters_quantized
        else f"BF16 ({layout.declared_in} leaves the adapters unquantized)"
    )
    tensors, shard_of = checkpoint.tensors, checkpoint.shard_of
    for layer in layout.layers:
        base = layout.adapter_prefix(layer)
        for key, contract in contracts.items():
            name = base + key
            tensor = tensors.get(name)
            if tensor is None:
                if checkpoint.weight_map.get(name) in checkpoint.broken_shards:
                    continue  # the shard's own problem says it
                log.add(
                    "missing",
                    name,
                    f"expected {_shape(contract.shape)} {contract.dtype_text}, {how}",
                    checkpoint.weight_map.get(name),
                )
                continue
            report.adapter_tensors_found += 1
            _log_breaches(log, name, contract, tensor, shard_of[name], f", {how}")
        for key in sorted(known - contracts.keys()):
            if base + key in tensors:
                log.add(
                    "unexpected",
                    base + key,
                    f"vLLM builds this layer's adapters {how}",
                    shard_of[base + key],
                )


def _log_shards(
    report: PreflightReport,
    checkpoint: CheckpointTensors,
    unread: dict[str, _UnreadShard],
) -> None:
    """One problem per broken shard, saying what it holds (or should)."""
    for shard, reason in checkpoint.broken_shards.items():
        if shard in unread:
            held = unread[shard]
            layers = "layers" if len(held.layers) > 1 else "layer"
            what = (
                f"; the index puts {held.tensors} routed-expert tensors in it "
                f"({layers} {layer_ranges(sorted(held.layers))})"
                if held.tensors
                else "; the index puts no routed-expert tensor in it"
                if checkpoint.weight_map
                else ""
            )
        else:
            what = f"; its header lists {checkpoint.tensors_in[shard]} tensors"
        report.problems.add("shard", shard, reason + what, shard)


def _log_unexpected(
    report: PreflightReport, leftover: dict, shard_of: dict[str, str]
) -> None:
    """Expert-like tensors that are not one of the expected ones."""
    layout = report.layout
    detail = (
        "looks like a routed-expert tensor, but vLLM's Kimi-K3 loader has no "
        f"parameter for it ({layout.format.tensors.label} experts: w1/w3/w2 x "
        f"{'/'.join(layout.format.tensors.suffixes)}, experts 0-"
        f"{layout.num_experts - 1} of layers {layer_ranges(layout.layers)} under "
        f"{layout.prefix})"
    )
    search = _ANY_EXPERT_TENSOR.search
    for name in leftover:
        if search(name):
            report.problems.add("unexpected", name, detail, shard_of[name])


def refuse_a_missing_directory(directory: Path) -> None:
    """``PreflightInputError`` unless ``directory`` is a directory."""
    if directory.is_dir():
        return
    if directory.exists():
        raise PreflightInputError(f"{directory} is a file, not a checkpoint directory")
    hub_id = len(directory.parts) == 2 and not directory.is_absolute()
    raise PreflightInputError(
        f"checkpoint directory {directory} does not exist"
        + ("; a Hugging Face id? check reads a downloaded copy" if hub_id else "")
    )


def preflight(
    directory: Path, parallelism: Topology, backend: str | None = None
) -> PreflightReport:
    """Check ``directory``'s routed experts for ``parallelism`` (and that
    ``backend``, if named, is an MoE kernel of the checkpoint's path)."""
    refuse_a_missing_directory(directory)
    layout = read_layout(directory, language_model=backend is not None)
    try:
        if backend is not None:
            validate_backend(layout.format.format.name, backend)
        validate_with_working_tp_sizes(layout.text_config, parallelism)
    except DeploymentError as error:
        raise PreflightInputError(str(error)) from None
    try:
        checkpoint = read_checkpoint_tensors(directory)
    except CheckpointDirError as error:
        raise PreflightInputError(str(error)) from None
    report = PreflightReport(
        directory,
        layout,
        parallelism,
        shards=len(checkpoint.shards),
        headers_read=checkpoint.headers_read,
        total_bytes=checkpoint.total_bytes,
    )
    _compare(report, checkpoint)
    _compare_adapters(report, checkpoint)
    if report.problems:
        pruned = (
            None  # a broken shard leaves layers short too
            if checkpoint.broken_shards
            else pruned_per_layer(layout, checkpoint.tensors)
        )
        if pruned is not None:
            report.mismatch, report.fix = pruned, PRUNED_PER_LAYER_FIX
        else:
            report.mismatch = mismatch(layout, checkpoint.tensors)
    return report
