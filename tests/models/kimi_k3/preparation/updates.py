"""One rank's routed experts served, then updated in place through vLLM's own
reload code, as a running server's weights are updated (RL weight sync,
EPLB's recovery), and compared with a fresh load of the same weights.

A rank is built and cold-loaded as vLLM's model loader does it
(``BaseModelLoader.load_model``: the model built, its reload metadata
recorded, its checkpoint loaded through ``load_weights``, an online layer's
processing finished, every module prepared for its kernel), on the CPU with
the kernels' compiled preparation stood in (``stand_ins``), every byte
``torch.empty`` hands out random (``random_uninitialised_memory``: on a GPU a
fresh allocation holds whatever was there). Then ``PATHS`` load new weights
into it the way each of vLLM's update paths does, each calling vLLM's own
functions. ``snapshot`` takes every tensor the experts hold after their
kernel prepared them, to be compared byte for byte.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tests.models.kimi_k3.gpu_stand_ins import random_uninitialised_memory
from tests.models.kimi_k3.preparation import stand_ins
from tests.models.kimi_k3.preparation.harness import (
    PreparationCase,
    PreparedLayer,
    _layer,
    _layer_topology,
)
from tests.models.kimi_k3.preparation.stand_ins.weight_transfer import (
    transfer_engine,
)
from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    one_gpu_for_the_data_parallel_group,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import (
    OnlineQuantization,
    rank_vllm_config,
)
from vllm_kimi_k3_moe.tools.selftest.checkpoint import expert_key
from vllm_kimi_k3_moe.tools.selftest.kernels import ReferenceKernel
from vllm_kimi_k3_moe.tools.selftest.layer import (
    build_moe_layers,
    kimi_moe,
    routed_experts,
    vision_language_model,
)

CPU = torch.device("cpu")
Weights = dict[str, torch.Tensor]


def weights_of(layer: PreparedLayer, version: int) -> Weights:
    """Version ``version`` of the layer's expert weights: version 0 is the
    synthetic checkpoint; version v gives expert e what expert e + v held
    (every tensor a valid one of its format, and a different one)."""
    if version == 0:
        return layer.tensors
    experts = layer.shape.experts
    moved = {}
    for key in layer.tensors:
        head, expert, projection, suffix = key.rsplit(".", 3)
        source = expert_key((int(expert) + version) % experts, projection, suffix)
        assert source.startswith(head), key
        moved[key] = layer.tensors[source]
    return moved


def _load_weights(model: nn.Module, wrapper: type, weights: Any) -> set[str]:
    """``KimiK3ForConditionalGeneration.load_weights`` (``wrapper``: the VL
    model of the language model's module): vLLM's ``AutoWeightsLoader`` with
    Kimi-K3's checkpoint name mapper."""
    from vllm.model_executor.models.utils import AutoWeightsLoader

    return AutoWeightsLoader(model).load_weights(
        weights, mapper=wrapper.hf_to_vllm_mapper
    )


@dataclass
class ServedRank:
    model: nn.Module  # Kimi-K3's module tree, with a ``load_weights``
    experts: nn.Module  # the rank's RoutedExperts
    vllm_config: Any
    layer: PreparedLayer


def prepare_for_kernel(served: ServedRank) -> None:
    """What vLLM runs after the checkpoint is loaded (``load_model``)."""
    from vllm.model_executor.model_loader.base_loader import _has_online_quant
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_processing,
    )
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_config = served.vllm_config.model_config
    if _has_online_quant(served.model):
        finalize_layerwise_processing(served.model, model_config)
    process_weights_after_loading(served.model, model_config, CPU)


@contextlib.contextmanager
def _kernel_on_cpu(served: ServedRank) -> Iterator[None]:
    """The stand-ins a kernel's weight preparation needs on the CPU."""
    with (
        stand_ins.loading(),
        stand_ins.on_cpu(),
        one_gpu_for_the_data_parallel_group(served.experts.moe_config),
    ):
        yield


@contextlib.contextmanager
def served_rank(
    kimi_model: ModuleType,
    case: PreparationCase,
    weights: int | Weights = 0,
    online: OnlineQuantization | None = None,
    seed: int = 0,
    redundant_experts: int = 0,
    selection: Callable[[Any], AbstractContextManager[Any]] | None = None,
) -> Iterator[ServedRank]:
    """``case``'s GPU built through the ``KimiMoE`` vLLM's model module holds
    now (the plugin's, or vLLM alone's), cold-loaded with version
    ``weights`` (a version of ``weights_of``, or the tensors themselves) and
    prepared for its kernel; posing as that rank for the
    block, uninitialised memory random (``seed``) throughout. With
    ``redundant_experts``: ``--enable-eplb`` with that many redundant
    experts (``ParallelConfig`` refuses EPLB off a CUDA platform, so its
    two fields are set after it checked). ``selection(deployment)``: the
    GPU's kernel selection (default: an NVIDIA GPU's, the CPU reference
    kernel's)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.v1.worker import workspace

    layer = _layer(case.config, _layer_topology(case.topology))
    selftest = case.selftest_case()
    topology = case.topology
    rank = case.gpu()
    with (
        random_uninitialised_memory(seed),
        simulated_rank(rank),
        (selection or ReferenceKernel().selection)(selftest.deployment(topology)),
    ):
        vllm_config = rank_vllm_config(
            layer.model_dir, topology, case.backend, online=online
        )
        if redundant_experts:
            vllm_config.parallel_config.enable_eplb = True
            eplb = vllm_config.parallel_config.eplb_config
            eplb.num_redundant_experts = redundant_experts
        with (
            set_current_vllm_config(vllm_config),
            replaced_attributes(workspace, _manager=workspace.WorkspaceManager(CPU)),
        ):
            with stand_ins.loading():
                model = build_moe_layers(
                    kimi_model, kimi_model.KimiMoE, vllm_config, "cpu"
                )
                record_metadata_for_reloading(model)  # vLLM's initialize_model
                wrapper = vision_language_model(kimi_model)
                model.load_weights = functools.partial(_load_weights, model, wrapper)
                experts = routed_experts(kimi_moe(model))
                served = ServedRank(model, experts, vllm_config, layer)
                if isinstance(weights, int):
                    weights = weights_of(layer, weights)
                model.load_weights(weights.items())
            with _kernel_on_cpu(served):
                prepare_for_kernel(served)
            yield served


def snapshot(experts: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer the experts hold, as bytes, but those no
    loader writes (vLLM's ``SKIP_LOAD_TENSORS``: the expert map, the
    router's correction bias, which the checkpoint's router holds)."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    tensors = dict(experts.named_parameters()) | dict(experts.named_buffers())
    return {
        name: tensor.detach().reshape(-1).contiguous().view(torch.uint8).clone()
        for name, tensor in tensors.items()
        if not tensor.is_meta and name.rsplit(".", 1)[-1] not in SKIP_LOAD_TENSORS
    }


def differences(found: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> list:
    """The tensors that differ from a fresh load's, by name."""
    names = sorted(found.keys() | fresh.keys())
    return [
        name
        for name in names
        if name not in found
        or name not in fresh
        or found[name].shape != fresh[name].shape
        or not torch.equal(found[name], fresh[name])
    ]


# --- vLLM's update paths, each as a running server takes it ------------------

# What one update sends: every (name, tensor) at once (a dict), or buckets in
# turn (a list), each a dict or an iterable that may raise partway (a source
# dying midway); ``RECEIVE_FAILS`` in the list is an engine's receive of the
# next bucket failing before anything of it is loaded, ``NO_FINISH`` its
# caller stopping there without a word (nothing calls finish).
Update = Weights | list[Any]


class SourceDied(RuntimeError):
    """The weights' source failed mid-update (a trainer dying mid-broadcast,
    a shard cut short, a receive timing out): not the plugin's, not vLLM's."""


class _ReceiveFails:
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise SourceDied("the engine's receive of a bucket failed")
        yield  # a generator: it raises where the bucket is received


RECEIVE_FAILS = _ReceiveFails()
NO_FINISH = object()


@dataclass
class DiesMidway:
    """A bucket whose source raises ``SourceDied`` after sending ``after``
    of ``weights`` (in order); read from disk, a shard holding all of them
    whose reading fails there."""

    weights: Weights
    after: int

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for count, pair in enumerate(self.weights.items()):
            if count == self.after:
                raise SourceDied(f"the weights' source died after {count} tensors")
            yield pair


def buckets_of(update: Update) -> list[Any]:
    """``update`` as the buckets an engine receives one by one (up to a
    ``NO_FINISH``)."""
    buckets = list(update) if isinstance(update, list) else [update]
    return buckets[: buckets.index(NO_FINISH)] if NO_FINISH in buckets else buckets


def finishes(update: Update) -> bool:
    """Whether the caller of ``update`` calls its finish."""
    return not (isinstance(update, list) and NO_FINISH in update)


def _pairs(bucket: Any) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(bucket.items()) if isinstance(bucket, dict) else iter(bucket)


def _one_stream(update: Update) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets_of(update):
        yield from _pairs(bucket)


@contextlib.contextmanager
def update_state() -> Iterator[dict]:
    """What one rank's updates through ``PATHS`` share: the load plan direct
    mode traces at its first update, and the directory the disk paths write
    each update's checkpoint into (tens of MB each), removed after."""
    with tempfile.TemporaryDirectory(prefix="kimi-k3-updates-") as directory:
        yield {"directory": directory}


def reload_weights(served: ServedRank, update: Update, state: dict) -> None:
    """The public entry (``collective_rpc("reload_weights")``, both
    releases): ``reload.inplace.reload_weights`` with an iterator of
    checkpoint-format tensors (buckets in turn, in one iterator), vLLM's
    layerwise reload."""
    from vllm.model_executor.model_loader.reload.inplace import (
        reload_weights as vllm_reload_weights,
    )

    with _kernel_on_cpu(served):
        vllm_reload_weights(
            served.vllm_config,
            served.model,
            _one_stream(update),
            weights_path=None,
            is_checkpoint_format=True,
        )


def start_and_finish(served: ServedRank, update: Update, state: dict) -> None:
    """The weight-transfer engines that reload layerwise or directly (IPC,
    NCCL without a plan, M2N's fallbacks), on both releases: vLLM's IPC
    engine, only its receive stood in (``stand_ins.weight_transfer``): its
    ``start_weight_update`` (vLLM 0.34's ``start_reload``, in the mode
    ``VLLM_RELOAD_MODE`` selects; 0.33's ``initialize_layerwise_reload``),
    ``update_weights`` once per bucket, ``finish_weight_update``."""
    engine = transfer_engine(served.model, served.vllm_config)
    with _kernel_on_cpu(served):
        engine.start_weight_update()
        for bucket in buckets_of(update):
            engine.update_weights({"bucket": _pairs(bucket)})
        if finishes(update):
            engine.finish_weight_update()


def load_plan(served: ServedRank, update: Update, state: dict) -> None:
    """vLLM 0.34's NCCL weight-transfer engine in direct mode, as its
    ``start_weight_update``, ``receive_weights`` (per bucket: the names
    checked against the metadata sent at init, ``_check_manifest``; then
    ``load_planned``) and ``finish_weight_update`` do: its first update
    traces ``load_weights`` into a load plan (``plan_loads``) over the
    metadata (every tensor of that first update, as a trainer declares its
    checkpoint), every update copies through the plan (straight into the
    storage, no ``weight_loader`` for a direct name)."""
    from vllm.distributed.weight_transfer.base import ParamMeta
    from vllm.distributed.weight_transfer.nccl_engine import (
        _check_manifest,
        _manifest,
    )
    from vllm.model_executor.model_loader.reload import (
        finish_reload,
        load_planned,
        plan_loads,
        start_reload,
    )

    with _kernel_on_cpu(served):
        start_reload(served.model)
        if "plan" not in state:
            metadata = state.get("metadata") or [
                ParamMeta(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))
                for name, tensor in served.layer.tensors.items()
            ]
            state["manifest"] = _manifest(metadata)
            state["plan"] = plan_loads(served.model, metadata)
        for bucket in buckets_of(update):
            tensors = list(_pairs(bucket))  # the broadcast of the bucket
            _check_manifest(
                state["manifest"], ((n, t.dtype, t.shape) for n, t in tensors)
            )
            load_planned(served.model, state["plan"], tensors)
        if finishes(update):
            finish_reload(served.model, served.vllm_config.model_config, CPU)


def eplb_recovery(served: ServedRank, update: Update, state: dict) -> None:
    """vLLM 0.34's recovery from a dead expert-parallel peer
    (``v1/worker/sentinel/eplb_redistribute.reload_experts_from_disk``): the
    layer's experts reloaded from the checkpoint on disk, placement kept,
    through ``initialize_layerwise_reload(layer, defer_processing=True)``."""
    from vllm.v1.worker.sentinel.eplb_redistribute import reload_experts_from_disk

    directory = _checkpoint_of(served, update, state)
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    # what KimiK3ForConditionalGeneration holds: its checkpoint name mapper,
    # and the MoE layers EPLB registers (MixtureOfExperts' moe_layers)
    served.model.hf_to_vllm_mapper = KimiK3ForConditionalGeneration.hf_to_vllm_mapper
    served.model.moe_layers = [kimi_moe(served.model).experts]
    experts = served.experts.moe_config.num_experts
    placement = torch.arange(experts).unsqueeze(0)
    config = served.vllm_config.model_config
    with (
        _kernel_on_cpu(served),
        _disk_read_failing(state),
        replaced_attributes(config, model=str(directory), model_weights=""),
    ):
        reload_experts_from_disk(
            served.model,
            served.vllm_config,
            {(0, expert) for expert in range(experts)},
            placement,
        )


def reload_from_disk(served: ServedRank, update: Update, state: dict) -> None:
    """The public entry with a directory the trainer saved
    (``collective_rpc("reload_weights", kwargs={"weights_path": ...})``):
    vLLM reads it with its default loader, through the plugin's patch."""
    from vllm.model_executor.model_loader.reload.inplace import (
        reload_weights as vllm_reload_weights,
    )

    directory = _checkpoint_of(served, update, state)
    with _kernel_on_cpu(served), _disk_read_failing(state):
        vllm_reload_weights(
            served.vllm_config,
            served.model,
            None,
            weights_path=str(directory),
            is_checkpoint_format=True,
        )


def _checkpoint_of(served: ServedRank, update: Update, state: dict) -> Path:
    """A new checkpoint directory holding every tensor ``update`` sends; a
    source that dies midway (``DiesMidway``) a shard whose reading fails
    after as many tensors as it sent (``_disk_read_failing``)."""
    directory = Path(state["directory"]) / f"v{len(state.setdefault('written', []))}"
    state.pop("fails_after", None)
    sent: Weights = {}
    for bucket in buckets_of(update):
        if isinstance(bucket, DiesMidway):
            state["fails_after"] = len(sent) + bucket.after
            sent.update(bucket.weights)
        else:
            sent.update(_pairs(bucket))
    _write_checkpoint(served.layer.model_dir, directory, sent)
    state["written"].append(directory)
    return directory


@contextlib.contextmanager
def _disk_read_failing(state: dict) -> Iterator[None]:
    """vLLM's shard reader (``default_loader``'s ``safetensors_weights_iterator``)
    raising after ``state["fails_after"]`` tensors, as a shard cut short on a
    network filesystem does; as it is where nothing fails."""
    after = state.get("fails_after")
    if after is None:
        yield
        return
    from vllm.model_executor.model_loader import default_loader

    own = default_loader.safetensors_weights_iterator

    def reading(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for count, item in enumerate(own(*args, **kwargs)):
            if count == after:
                raise SourceDied("a shard was cut short mid-read")
            yield item

    with replaced_attributes(default_loader, safetensors_weights_iterator=reading):
        yield


def _write_checkpoint(model_dir: Path, directory: Path, weights: Weights) -> None:
    """A checkpoint directory of ``weights``: ``model_dir``'s files and one
    safetensors shard."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, directory)
    save_file(
        {key: tensor.contiguous() for key, tensor in weights.items()},
        os.fspath(directory / "model.safetensors"),
    )


def reload_mode_of(path: str) -> str:
    """The ``VLLM_RELOAD_MODE`` the update path ``path`` runs in: vLLM 0.34's
    direct mode for ``direct`` and load plans, else the layerwise default."""
    return "direct" if path in ("direct", "load_plan") else "layerwise"


def has_lifecycle() -> bool:
    """vLLM 0.34's update lifecycle (``start_reload`` / ``finish_reload``,
    direct mode, load plans, EPLB's recovery); 0.33 has none."""
    from vllm.model_executor.model_loader import reload

    return hasattr(reload, "start_reload")


# Formats beside the release, each on Marlin: FP8 in [128, 128] blocks, NVFP4,
# INT4 in groups of 128 (AutoAWQ). At TP32 their whole groups of 128 rows
# leave GPUs 24 to 31 none of FP8's and INT4's: test them on GPU 0.
OTHER_FORMATS = [("fp8-block", "marlin"), ("nvfp4", "marlin"), ("awq", "marlin")]

PATHS: dict[str, Callable[[ServedRank, Weights, dict], None]] = {
    "reload_weights": reload_weights,
    "start_reload": start_and_finish,
    "direct": start_and_finish,  # with VLLM_RELOAD_MODE=direct
    "load_plan": load_plan,
    "eplb_recovery": eplb_recovery,
}
