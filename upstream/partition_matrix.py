"""What vLLM allocates for Kimi-K3's routed experts, and what it loads into
them, for every case of the format x backend x topology matrix.

Run in a Python whose vLLM is the one to describe: released vLLM with this
plugin, or a patched vLLM copy with ``VLLM_PLUGINS=""``. vLLM's own
``load_general_plugins()`` decides, from ``VLLM_PLUGINS``, whether the plugin
takes part; the dump records which form it saw. Nothing here knows the
plugin's machinery: it builds vLLM's ``KimiMoE`` as vLLM's module exposes it.

Per case (format: each published Kimi-K3 checkpoint format and the integer
groups beside them, ``project_helpers.MATRIX_FORMATS``; backend: every
``--moe-backend`` but ``auto``; topology: the regression suite's ten, TP1 to
TP32, TP16 x DP2 and TP8 x DP4 (experts split through data parallelism) and
TP32 with expert parallelism), the dump holds:

- rank 0's layer at Kimi-K3's real size on the ``meta`` device: the
  per-rank partition (``intermediate_size_per_partition``) or the error
  vLLM raised, the quantization method and kernel, whether TP loading is
  block-aligned, and a digest of every parameter's name, shape and dtype;
- every rank's layer at a small size on CPU (latent width 256, the real
  3072 intermediate, a few experts, no shared experts), after vLLM's
  Kimi-K3 ``load_weights`` fed it a checkpoint in the case's format: a
  digest of every parameter's bytes, pads included. Memory ``torch.empty``
  hands out reads as 0xA5 bytes, so a pad nobody zeroed shows.

Loading every rank of every backend separately would take minutes. Cases
whose small rank-0 layer is the same in everything the loader reads (method
class, each parameter's name, shape, dtype and loader attributes, the MoE
config's sizes and block-aligned flag), over the same number of GPUs per
expert, share one loaded representative: the loader reads a rank's place
in the flattened TP x DP group only (TP8 x DP4 rank r is TP32's rank r);
the dump says which.

``python -m upstream.partition_matrix OUT.json`` writes the dump
(``upstream.verify_patch.compare`` lists the cases where two dumps differ).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import json
import sys
import typing
from pathlib import Path
from typing import Any

import torch
from torch import nn

from upstream import project_helpers as helpers

KIMI_K3_NVIDIA_MODEL = "vllm.models.kimi_k3.nvidia.model"
LAYER = 1  # the MoE layer built: the first after Kimi-K3's dense layer 0
SMALL_HIDDEN = 256  # latent width of the small layers (Marlin pads none)
SMALL_EXPERTS = 4
POISON = 0xA5  # what uninitialised CPU memory reads as here


def moe_backends() -> list[str]:
    """Every ``--moe-backend`` vLLM takes, but ``auto`` (resolved on a GPU)."""
    from vllm.config.kernel import MoEBackend

    return [name for name in typing.get_args(MoEBackend) if name != "auto"]


def case_key(fmt: str, backend: str, topology: helpers.Topology) -> str:
    return f"{fmt} | {backend} | {topology.label()}"


def ranks(topology: helpers.Topology) -> list[helpers.Rank]:
    """Every rank of ``topology`` (TP x DP)."""
    return [
        helpers.Rank(topology, tp_rank=tp, dp_rank=dp)
        for dp in range(topology.dp_size)
        for tp in range(topology.tp_size)
    ]


def form(model: Any) -> str:
    """Which form of the fix this vLLM runs: the plugin's patched class in
    ``KimiMoE``'s MRO, or vLLM's own ``KimiMoE``."""
    plugin = any(
        cls.__module__.split(".")[0] == helpers.plugin_package
        for cls in model.KimiMoE.__mro__
    )
    return "plugin" if plugin else "vllm"


def build_experts(
    model: Any,
    fmt: str,
    backend: str,
    rank: helpers.Rank | helpers.Topology,
    *,
    small: bool,
) -> nn.Module:
    """One rank's ``KimiMoE`` (a topology: its rank 0; ``small``: on CPU at
    the small size, else on ``meta`` at Kimi-K3's size), built as
    ``KimiDecoderLayer`` builds it; returns its ``RoutedExperts``."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    topology = rank.topology if isinstance(rank, helpers.Rank) else rank
    overrides: dict[str, Any] = {}
    if small:
        experts = SMALL_EXPERTS
        if topology.expert_parallel:
            experts = max(experts, topology.moe_group)
        overrides = {
            "hidden_size": 2 * SMALL_HIDDEN,
            "routed_expert_hidden_size": SMALL_HIDDEN,
            "num_experts": experts,
            "num_experts_per_token": 2,
            # Not routed experts, and most of a small layer's build time.
            "num_shared_experts": None,
        }
    config = helpers.kimi_k3_text_config(**overrides)
    vllm_config = helpers.format_vllm_config(rank, fmt, backend)
    with (
        helpers.simulated_rank(rank),
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(torch.bfloat16),
        torch.device("cpu" if small else "meta"),
        helpers.uninitialised_memory_reads(POISON)
        if small
        else contextlib.nullcontext(),
    ):
        moe = model.KimiMoE(
            config,
            vllm_config,
            quant_config=vllm_config.quant_config,
            prefix=f"language_model.model.layers.{LAYER}.block_sparse_moe",
        )
    experts_module = moe.experts.routed_experts
    experts_module.kimi_k3_text_config = config
    return experts_module


def load(model: Any, experts: nn.Module, fmt: str) -> None:
    """Feed ``experts`` a checkpoint in ``fmt`` through vLLM's Kimi-K3
    ``KimiLinearModel.load_weights`` (its expert name mapping included)."""
    config = experts.kimi_k3_text_config

    class MoeLayerOnlyModel(model.KimiLinearModel):
        """Stands in for ``KimiLinearModel`` with only its MoE layer
        ``LAYER``: the attention layers pick kernels for the current
        platform at construction, which a CPU lacks."""

        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.config = config
            self.layers = nn.ModuleList(nn.Module() for _ in range(LAYER + 1))
            self.layers[LAYER].block_sparse_moe = nn.Module()
            self.layers[LAYER].block_sparse_moe.experts = nn.Module()
            self.layers[LAYER].block_sparse_moe.experts.routed_experts = experts

    checkpoint = _checkpoint(
        fmt,
        config.num_experts,
        config.routed_expert_hidden_size,
        config.moe_intermediate_size,
    )
    MoeLayerOnlyModel().load_weights(
        (name.removeprefix("language_model."), tensor)
        for name, tensor in checkpoint.items()
    )


@functools.cache
def _checkpoint(
    fmt: str, num_experts: int, hidden: int, intermediate: int
) -> dict[str, torch.Tensor]:
    """Layer ``LAYER``'s routed experts in ``fmt``, seeded, never zero."""
    spec = helpers.KimiK3Spec(
        routed_expert_hidden_size=hidden,
        moe_intermediate_size=intermediate,
        num_experts=num_experts,
        num_hidden_layers=LAYER + 1,
        num_nextn_predict_layers=0,
    )
    return helpers.expert_checkpoint(spec, fmt)


def _digest(items: list[Any]) -> str:
    h = hashlib.sha256()
    for item in items:
        if isinstance(item, torch.Tensor):
            h.update(item.detach().contiguous().view(-1).view(torch.uint8).numpy())
        else:
            h.update(repr(item).encode())
    return h.hexdigest()[:16]


def _parameters(experts: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return sorted(experts.named_parameters(recurse=False))


def shapes_digest(experts: nn.Module) -> str:
    return _digest([(n, tuple(p.shape), str(p.dtype)) for n, p in _parameters(experts)])


def bytes_digest(experts: nn.Module) -> str:
    items: list[Any] = []
    for name, param in _parameters(experts):
        items += [(name, tuple(param.shape), str(param.dtype)), param.data]
    return _digest(items)


_LOADER_ATTRIBUTE_TYPES = (str, int, float, bool, type(None))


def loader_signature(experts: nn.Module) -> str:
    """Everything the loader reads of a built layer, as one digest."""
    config = experts.moe_config
    items: list[Any] = [
        type(experts.quant_method).__qualname__,
        config.intermediate_size,
        config.intermediate_size_per_partition,
        config.intermediate_size_per_partition_unpadded,
        config.tp_shard_with_padding,
    ]
    for name, param in _parameters(experts):
        attributes = sorted(
            (k, v)
            for k, v in vars(param).items()
            if isinstance(v, _LOADER_ATTRIBUTE_TYPES)
        )
        items.append((name, tuple(param.shape), str(param.dtype), attributes))
    return _digest(items)


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def describe_case(
    model: Any, fmt: str, backend: str, topology: helpers.Topology
) -> dict[str, Any]:
    """Rank 0 at Kimi-K3's size: what vLLM allocates, or the error it raises."""
    try:
        experts = build_experts(model, fmt, backend, topology, small=False)
    except Exception as error:
        return {"error": _error(error)}
    return {
        "partition": experts.intermediate_size_per_partition,
        "method": type(experts.quant_method).__name__,
        "kernel": helpers.backend_name(experts.quant_method),
        "block_aligned_loading": experts.moe_config.tp_shard_with_padding,
        "parameters": shapes_digest(experts),
    }


def load_ranks(
    model: Any, fmt: str, backend: str, topology: helpers.Topology
) -> list[str]:
    """Every rank's small layer after loading, as a digest of its bytes."""
    digests = []
    for rank in ranks(topology):
        try:
            experts = build_experts(model, fmt, backend, rank, small=True)
            load(model, experts, fmt)
            digests.append(bytes_digest(experts))
        except Exception as error:
            digests.append(_error(error))
    return digests


def dump(
    formats: list[str], backends: list[str] | None = None, progress: bool = False
) -> dict[str, Any]:
    """The matrix, as the vLLM importable here allocates and loads it."""
    from vllm.plugins import load_general_plugins

    # Layers this small run faster on one thread (and the CPU is shared).
    torch.set_num_threads(1)
    load_general_plugins()  # VLLM_PLUGINS decides whether the plugin joins
    model = importlib.import_module(KIMI_K3_NVIDIA_MODEL)
    import vllm

    backends = backends or moe_backends()
    cases: dict[str, Any] = {}
    loaded: dict[tuple[str, str, str], tuple[str, list[str]]] = {}
    with helpers.moe_kernels_on_their_gpu():
        for fmt in formats:
            for topology in helpers.TOPOLOGIES:
                for backend in backends:
                    case = describe_case(model, fmt, backend, topology)
                    cases[case_key(fmt, backend, topology)] = case
                    if "error" in case:
                        continue
                    try:
                        rank0 = build_experts(model, fmt, backend, topology, small=True)
                        signature = loader_signature(rank0)
                    except Exception as error:
                        signature = _error(error)
                    flat = (topology.moe_group, topology.expert_parallel)
                    group = (fmt, flat, signature)
                    if group not in loaded:
                        loaded[group] = (
                            f"{backend} at {topology.label()}",
                            load_ranks(model, fmt, backend, topology),
                        )
                    case["loaded_as"], case["ranks"] = loaded[group]
                if progress:
                    print(f"{fmt} {topology.label()}", file=sys.stderr)
    return {
        "form": form(model),
        "vllm": str(Path(vllm.__file__).parent),
        "rank_loads": sum(len(r) for _, r in loaded.values()),
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m upstream.partition_matrix", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="where to write the JSON dump")
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(helpers.MATRIX_FORMATS),
        help="checkpoint formats (default: the published ones and integer groups)",
    )
    parser.add_argument("--backends", nargs="+", help="default: every --moe-backend")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    result = dump(args.formats, args.backends, args.progress)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    built = sum("error" not in case for case in result["cases"].values())
    print(
        f"{args.out}: {len(result['cases'])} cases, {built} built, "
        f"{result['rank_loads']} rank loads, on {result['form']} ({result['vllm']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
