"""Kimi-K3 routed experts load strictly: malformed or incomplete checkpoints fail.

Patch ledger entry
------------------
Replaces
    ``vllm.models.kimi_k3.nvidia.model.KimiMoE`` by a subclass layer
    (``patching.add_subclass_layer``, independent of the padding patch's)
    whose ``__init__`` runs upstream's, then installs strict loading. For
    the routed experts of each Kimi-K3 NVIDIA ``KimiMoE`` (main model and
    MTP draft) in a format the registry knows (``vllm_kimi_k3_moe.formats``:
    MXFP4 native and compressed-tensors, FP8 block, NVFP4 compressed-tensors
    and ModelOpt, INT4 W4A16, BF16) it replaces the ``weight_loader``
    attribute of each expert parameter a checkpoint tensor of the format
    loads into: the TP-sharded weights and scales, and the per-tensor
    values (NVFP4 global and input scales, W4A16 ``weight_shape``)
    (upstream: the bound ``RoutedExperts.weight_loader``), and the layer's
    ``quant_method.process_weights_after_loading``. Both are instance
    attributes; no other vLLM class or model is touched.
Why
    vLLM 0.33.0's and 0.34.0's generic expert loader narrows or partially copies
    wrong-sized checkpoint tensors without a word (an intermediate of 2048,
    3000 or 4096 instead of 3072 loads "fine"), and nothing notices an expert
    tensor that was never loaded: the layer then serves zeros or garbage for
    that expert. Nor does it look at dtypes: ``copy_`` casts, so an NVFP4
    ``weight_packed`` stored as bfloat16 is written value by value into the
    packed bytes.
How
    Before upstream's loader runs, the checkpoint tensor is held to its
    format's tensor contract (``formats.layouts.TensorContract``, the one
    ``check`` holds shard headers to): the logical expert shape (w1/w3
    ``[moe_intermediate_size, hidden]``, w2 ``[hidden, moe_intermediate_size]``,
    packed or grouped as the format stores them) and the dtypes the format
    stores it in. A breach raises ``ValueError`` naming the checkpoint tensor
    by its key in the checkpoint
    (``vllm_kimi_k3_moe.model_executor.model_loader.default_loader``), the
    expert, and the shapes or dtypes expected and found, before any byte is
    copied. Valid tensors are handed on to the parameter's own loader. At
    the cold start (until the layer is first prepared for its kernel), each
    slice (expert x projection x suffix) written on this rank is recorded;
    a second write raises before copying, and just before the quantization
    method post-processes the layer, slices never written raise
    ``ValueError`` listing them. A layer that received no expert tensor at
    all is left alone unless another Kimi-K3 layer of the same model did
    (dummy weights, tensorizer and pre-processed weight caches fill
    parameters without the loader). Not recorded: a call on a ``meta``
    tensor (vLLM's layerwise loader runs each loader once there to count
    what it writes, then again on the materialised tensor), and every load
    after the cold start. Those are in-place updates (RL weight sync, EPLB's
    recovery; ``docs/design.md``), which may deliver any part of the
    checkpoint, or write through a load plan without calling a loader: each
    tensor an update hands a loader is still held to its contract. A breach
    in an update first gives every layer the update left open the kernel
    tensors it held (``model_loader.unfinished_update``), so the refusal
    leaves the engine serving, and its message names the tensor as the
    caller sent it and says what the engine holds now. What an update hands
    the loaders is recorded, and the layer's preparation after it keeps
    what it did not send (``partial_updates``).
Related PR
    None upstream: vLLM's generic loader has the same gap for every MoE model;
    this plugin closes it for Kimi-K3, whose 1.5-2.8 TB checkpoints make a
    silently wrong expert costly to find.
Delete when
    vLLM's ``RoutedExperts.weight_loader`` validates expert shapes and
    completeness itself; re-check at every vLLM bump (on other vLLM code the
    plugin checks ``TARGETS`` first: ``vllm_kimi_k3_moe.verification``).
Verified against
    vLLM 0.33.0 and 0.34.0 (``compat.VERIFIED_VLLM_RELEASES``): CI runs the
    whole test suite on each.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from vllm_kimi_k3_moe.compat import load_plan_trace_name
from vllm_kimi_k3_moe.formats import KimiK3Format, format_of_method
from vllm_kimi_k3_moe.formats.bf16 import BF16
from vllm_kimi_k3_moe.formats.layouts import (
    PARAMETER_PROJECTIONS,
    ExpertTensors,
    TensorContract,
    safetensors_dtype,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.fresh_tensors import (
    zeroing_first,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import is_online
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partial_updates import (
    Sent,
    check_before_preparing,
    delivery,
    keep_unsent,
    layerwise_kernel_tensors,
)
from vllm_kimi_k3_moe.model_executor.model_loader.default_loader import (
    checkpoint_key_of,
)
from vllm_kimi_k3_moe.model_executor.model_loader.unfinished_update import (
    direct_mode,
    name_as_sent,
    put_back_open_layers,
    what_the_engine_holds,
)
from vllm_kimi_k3_moe.patching import (
    add_subclass_layer,
    remove_subclass_layer,
    upstream_class,
)

# What the patch replaces or relies on (``vllm_kimi_k3_moe.verification``):
# the class it layers (whose __init__ it calls), the loader it hands on to,
# and the layerwise reload's counting pass on ``meta`` (which it leaves out
# of its ledger).
TARGETS = (
    "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.weight_loader",
    # (and counts through its CopyCounter, which the strict loader uses too)
    "vllm.model_executor.model_loader.reload.meta:get_numel_loaded",
    # what a refused update gives back (``unfinished_update``): the layers an
    # update opened, their set-aside kernel tensors and vLLM's own way back
    "vllm.model_executor.model_loader.reload.layerwise:initialize_layerwise_reload",
    "vllm.model_executor.model_loader.reload.layerwise:_place_kernel_tensors",
    # a method quantizing while it loads: its loaders wrapped around the strict
    "vllm.model_executor.model_loader.reload.layerwise:initialize_online_processing",
    "vllm.model_executor.model_loader.reload.types:LayerReloadingInfo.reset",
)

# the name of vLLM's layerwise loading wrapper (``reload/layerwise.py``)
ONLINE_LOADER = "online_process_loader"

# Expert parameters: "w13_weight_packed" -> (w13, weight_packed)
_EXPERT_PARAMETER = re.compile(r"(w13|w2)_(\w+)")


class ModelLoad:
    """The Kimi-K3 expert layers of one model (built under one ``VllmConfig``):
    whether the loader has handed any of them a checkpoint tensor yet."""

    def __init__(self) -> None:
        self.started = False


# id(config) -> (the config where it cannot be weakly referenced, its load)
_model_loads: dict[int, tuple[Any, ModelLoad]] = {}


def model_load(vllm_config: Any) -> ModelLoad:
    """The load state shared by every layer built under ``vllm_config``
    (forgotten with it), or a layer's own where it was built under none."""
    if vllm_config is None:
        return ModelLoad()
    key = id(vllm_config)
    known = _model_loads.get(key)
    if known is not None:  # alive: a weakly held config leaves with its entry
        return known[1]
    load = ModelLoad()
    try:
        weakref.finalize(vllm_config, _model_loads.pop, key, None)
        _model_loads[key] = (None, load)
    except TypeError:
        # A config without weak references (vLLM's unit tests build layers
        # under a ``SimpleNamespace``): held here, so its id is not reused
        _model_loads[key] = (vllm_config, load)
    return load


@dataclass(frozen=True, order=True, slots=True)  # ~5k per layer while loading
class ExpertSlice:
    """One checkpoint tensor of one expert, as this rank holds it."""

    expert_id: int
    projection: str  # w1 (gate), w3 (up), w2 (down)
    suffix: str  # as in the checkpoint: weight, weight_packed, weight_scale

    def __str__(self) -> str:
        return f"{self.expert_id}.{self.projection}.{self.suffix}"


class StrictExpertLoading:
    """Tensor contracts and a write ledger for one Kimi-K3 ``RoutedExperts``."""

    def __init__(
        self,
        experts: nn.Module,
        moe_intermediate_size: int,
        tensors: ExpertTensors,
        load: ModelLoad,
        kimi_moe_module: str,
    ) -> None:
        self.experts = experts
        self.load = load
        self.layer_name: str = experts.layer_name
        self.hidden_size: int = experts.moe_config.hidden_dim_unpadded
        self.intermediate_size = moe_intermediate_size
        self.format_name = tensors.label
        # (projection, checkpoint suffix) -> what that tensor must be
        self.contracts: dict[tuple[str, str], TensorContract] = tensors.contracts(
            self.hidden_size, moe_intermediate_size
        )
        # (projection, suffix) of every checkpoint tensor an expert has here
        self.expert_tensors: list[tuple[str, str]] = []
        self.written: set[ExpertSlice] = set()
        # what the in-place update under way handed the loaders on memory,
        # or wrote through a load plan (``model_loader.reload.plan``)
        self.sent = Sent()
        # checkpoint name -> its slice here, as a load plan's trace met them
        self.planned: dict[str, ExpertSlice] = {}
        # the module the update under way started on (``start_update``)
        self._update_model: Callable[[], nn.Module | None] = lambda: None
        # whether vLLM's direct-mode begin viewed this layer's kernel tensors
        # back to the checkpoint's layout (``model_loader.reload.direct``)
        self.viewed_back = False
        # Until the layer is first prepared for its kernel (vLLM's cold
        # start), every expert tensor must arrive once; after it, loads are
        # in-place updates (``check_complete``).
        self.cold_start = True
        # What this layer's keys start with in the checkpoint, once seen.
        self.checkpoint_prefix = f"{self.layer_name}."
        # ... and in what an update's caller sends (the checkpoint's names)
        self.sent_prefix = f"{name_as_sent(self.layer_name, kimi_moe_module)}."

    def checkpoint_name(self, expert_slice: ExpertSlice) -> str:
        """This slice's key in the checkpoint (as far as this layer knows)."""
        return f"{self.checkpoint_prefix}{expert_slice}"

    def is_local(self, expert_id: int) -> bool:
        return bool(self.experts.expert_map_manager.is_local_expert(expert_id))

    def local_experts(self) -> dict[int, int]:
        """This GPU's experts: global id -> its index in the layer's tensors."""
        experts = self.experts
        return {
            expert: experts._map_global_expert_id_to_local_expert_id(expert)
            for expert in range(experts.global_num_experts)
            if self.is_local(expert)
        }

    def loader_for(self, suffix: str, own: Callable[..., Any]) -> Callable[..., Any]:
        """The ``weight_loader`` for the expert parameter the checkpoint
        tensors ``<projection>.<suffix>`` load into, in front of its own
        (``own``)."""

        def weight_loader(
            param: nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool | None:
            expert_slice = ExpertSlice(expert_id, shard_id, suffix)
            # This model is loaded through the loader (on an EP rank, maybe
            # none of its own experts): every layer is then held to the check.
            self.load.started = True
            self.learn_checkpoint_prefix(expert_slice, loaded_weight)
            self.check_contract(expert_slice, loaded_weight, weight_name)
            call = functools.partial(
                own,
                param,
                loaded_weight,
                weight_name,
                shard_id=shard_id,
                expert_id=expert_id,
                return_success=return_success,
            )
            traced = load_plan_trace_name(loaded_weight)
            if traced is not None:
                # vLLM 0.34 planning a load plan: no data, nothing written;
                # where the name lands is what the plan writes later
                if self.is_local(expert_id):
                    self.planned[traced] = expert_slice
                return call()
            # The ledger is the cold start's. On ``meta`` vLLM's layerwise
            # loader only counts what a call would write (it replays the call
            # on the materialised tensor); an update may deliver any part of
            # the checkpoint, or write without calling a loader at all.
            ledger = self.cold_start and not param.is_meta
            local = ledger and self.is_local(expert_id)
            if local and expert_slice in self.written:
                raise ValueError(
                    f"Kimi-K3 checkpoint tensor {self.checkpoint_name(expert_slice)}"
                    f" (expert {expert_id}, into {weight_name}) is loaded a second"
                    " time; the checkpoint must hold each expert tensor once."
                )
            if param.is_meta and not self.cold_start and self.is_local(expert_id):
                return counted_even_if_empty(call)
            result = call()
            if local:
                self.written.add(expert_slice)
            elif not (self.cold_start or param.is_meta) and self.is_local(expert_id):
                self.sent.add(expert_id, shard_id, suffix)
            return result

        return weight_loader

    def learn_checkpoint_prefix(
        self, expert_slice: ExpertSlice, loaded_weight: torch.Tensor
    ) -> None:
        key = checkpoint_key_of(loaded_weight)
        if key is not None and key.endswith(f".{expert_slice}"):
            self.checkpoint_prefix = key[: -len(str(expert_slice))]
            self.sent_prefix = self.checkpoint_prefix

    def check_contract(
        self,
        expert_slice: ExpertSlice,
        loaded_weight: torch.Tensor,
        weight_name: str,
    ) -> None:
        """Refuse, before anything is written, a tensor whose shape or dtype
        breaks its contract (the dtype as safetensors names it: what the
        shard header says, and what ``check`` compares). In an in-place
        update, the layers the update left open are first given back what
        they held (``unfinished_update``), and the message says so."""
        contract = self.contracts[(expert_slice.projection, expert_slice.suffix)]
        dtype = safetensors_dtype(str(loaded_weight.dtype))
        breaches = contract.breaches(tuple(loaded_weight.shape), dtype)
        if not breaches:
            return
        what = self.describe(breaches, loaded_weight.dtype)
        if self.cold_start:
            raise ValueError(
                f"Kimi-K3 checkpoint tensor {self.checkpoint_name(expert_slice)} "
                f"(expert {expert_slice.expert_id}, loaded into {weight_name}) "
                f"{what}; nothing was written."
            )
        put_back = put_back_open_layers(self.update_model())
        raise ValueError(
            f"Kimi-K3 weight update refused: tensor "
            f"{self.sent_name(expert_slice)} (expert {expert_slice.expert_id}, "
            f"into {weight_name}) {what}. "
            + what_the_engine_holds(
                put_back, "Send the update again with this tensor whole"
            )
        )

    def describe(self, breaches: list[Any], torch_dtype: Any = None) -> str:
        """What a tensor's ``breaches`` of its contract are, in words."""
        what = []
        for breach in breaches:
            if breach.kind == "shape":
                what.append(
                    f"has shape {breach.found}, expected {breach.expected} for "
                    f"moe_intermediate_size={self.intermediate_size} and expert "
                    f"hidden size {self.hidden_size}"
                )
            else:
                found = (
                    f"{breach.found} ({torch_dtype})" if torch_dtype else breach.found
                )
                what.append(f"has dtype {found}, expected {breach.expected}")
        return f"{' and '.join(what)} in {self.format_name}"

    def sent_name(self, expert_slice: ExpertSlice) -> str:
        """The slice's name as the caller of an update sends it: the
        checkpoint's, before the model's ``hf_to_vllm_mapper`` renamed it."""
        return f"{self.sent_prefix}{expert_slice}"

    def expected_slices(self) -> set[ExpertSlice]:
        """Every slice this rank must receive: its local experts' tensors."""
        local = self.local_experts()
        return {
            ExpertSlice(expert, projection, suffix)
            for projection, suffix in self.expert_tensors
            for expert in local
        }

    def missing(self) -> list[ExpertSlice]:
        return sorted(self.expected_slices() - self.written)

    def start_update(self, model: nn.Module, viewed_back: bool = False) -> None:
        """An in-place update starts on ``model`` (the module vLLM's reload
        was started on, this layer among its modules): nothing sent yet.
        ``viewed_back``: vLLM's direct mode began by viewing this layer's
        kernel tensors back to the checkpoint's layout (they stay so until
        the layer is prepared again: a refused update leaves them so)."""
        self.sent = Sent()  # what an update that did not finish sent: forgotten
        self._update_model = weakref.ref(model)
        self.viewed_back = self.viewed_back or viewed_back

    def update_model(self) -> nn.Module | None:
        """The module the update under way started on (where a refusal
        puts back what the update left open), if known."""
        return self._update_model()

    def prepare_update(
        self, layer: nn.Module, process_weights: Callable[[nn.Module], None]
    ) -> None:
        """Prepare the layer for its kernel after an in-place update, keeping
        what the update did not send (``partial_updates``)."""
        sent, self.sent = self.sent, Sent()
        previous = layerwise_kernel_tensors(layer)
        in_direct_mode = previous is None and direct_mode()
        if previous is None and not in_direct_mode:
            process_weights(layer)
            return
        local = self.local_experts()
        found = delivery(sent, local, self.expert_tensors)
        name = self.sent_prefix.rstrip(".")
        model = self.update_model()
        viewed_back = in_direct_mode and self.viewed_back
        check_before_preparing(model, name, sent, found, in_direct_mode, viewed_back)
        process_weights(layer)
        self.viewed_back = False
        if previous is not None:
            keep_unsent(model, layer, name, previous, found, local)

    def end_cold_start(self) -> None:
        """The cold start is over (the layer is about to be prepared for its
        kernel): every slice must have been written; from now on loads are
        in-place updates, held to the contracts only."""
        self.check_complete()
        self.cold_start = False
        self.written.clear()

    def check_complete(self) -> None:
        """Raise ``ValueError`` listing the expert tensors never loaded."""
        if not self.written and not self.load.started:
            return  # Filled without the loader (dummy, tensorizer, caches).
        missing = self.missing()
        if missing:
            raise ValueError(
                f"Kimi-K3 layer {self.checkpoint_prefix.rstrip('.')}: "
                f"{len(missing)} routed-expert checkpoint tensors were never "
                f"loaded: {_describe(missing)}. The checkpoint is incomplete."
            )


def counted_even_if_empty(call: Callable[[], Any]) -> Any:
    """``call()``, a loader's call on ``meta`` in vLLM's layerwise reload,
    which counts the elements each call copies (``reload.meta.
    get_numel_loaded``) and keeps a layer whose calls copied none as it was,
    unprepared. A GPU the partition gives none of a tensor's rows (whole
    scale groups leave the last GPUs none) receives its whole share of an
    update as nothing: one element copied on ``meta`` counts it as received,
    so the layer is prepared at the update's finish as a fresh load prepares
    it (its pads zero). Left as it was, its kernel tensors would keep what
    a level-2 sleep or the weight checker's reset put there."""
    from vllm.model_executor.model_loader.reload.meta import CopyCounter

    with CopyCounter() as counter:
        result = call()
    if counter.copied_numel == 0:
        token = torch.empty(1, device="meta")
        token.copy_(token)
    return result


def _describe(missing: list[ExpertSlice], max_experts: int = 16) -> str:
    by_expert: dict[int, list[str]] = defaultdict(list)
    for expert_slice in missing:
        by_expert[expert_slice.expert_id].append(
            f"{expert_slice.projection}.{expert_slice.suffix}"
        )
    shown = [
        f"expert {expert} ({', '.join(tensors)})"
        for expert, tensors in list(by_expert.items())[:max_experts]
    ]
    if len(by_expert) > max_experts:
        shown.append(f"and {len(by_expert) - max_experts} more experts")
    return "; ".join(shown)


def expert_layouts(
    method: Any, fmt: KimiK3Format | None = None
) -> tuple[ExpertTensors, dict[str, str]] | None:
    """The checkpoint tensors of ``method``'s experts in their format (the
    one that loads ``method``, or ``fmt``) and, per expert parameter suffix
    (``w13_<suffix>``), the checkpoint suffix of the tensors it loads; None
    for a method no known format is loaded by."""
    fmt = fmt or format_of_method(method)
    if fmt is None:
        return None
    tensors = fmt.tensors_of_method(method)
    return tensors, {
        fmt.parameter_suffixes.get(suffix, suffix): suffix
        for suffix in tensors.suffixes
    }


def make_expert_loading_strict(
    kimi_moe: nn.Module, moe_intermediate_size: int, vllm_config: Any
) -> None:
    """Install strict loading on the routed experts inside ``kimi_moe``, one
    layer of the model built under ``vllm_config``."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    for experts in kimi_moe.modules():
        if isinstance(experts, RoutedExperts):
            method = experts.quant_method
            # a method quantizing while it loads takes the BF16 checkpoint's
            known = expert_layouts(method, BF16 if is_online(method) else None)
            if known is not None:
                tensors, checkpoint_suffixes = known
                loading = StrictExpertLoading(
                    experts,
                    moe_intermediate_size,
                    tensors,
                    model_load(vllm_config),
                    upstream_class(type(kimi_moe)).__module__,
                )
                _install(experts, loading, checkpoint_suffixes)


def _install(
    experts: nn.Module,
    loading: StrictExpertLoading,
    checkpoint_suffixes: dict[str, str],
) -> None:
    online = False
    for name, param in experts.named_parameters(recurse=False):
        match = _EXPERT_PARAMETER.fullmatch(name)
        if match is None or match.group(2) not in checkpoint_suffixes:
            continue
        stem, parameter_suffix = match.groups()
        suffix = checkpoint_suffixes[parameter_suffix]
        projections = PARAMETER_PROJECTIONS[stem]
        loading.expert_tensors += [(projection, suffix) for projection in projections]
        own = param.weight_loader
        if getattr(own, "__name__", "") != ONLINE_LOADER:
            param.weight_loader = loading.loader_for(suffix, own)
            continue
        # A method quantizing while it loads: vLLM wrapped the loader to
        # buffer what arrives (``online_process_loader``, the zeroing of
        # fresh tensors around it, both unwrapped by that name when vLLM
        # replays). The strict loader goes next to the original, the zeroing
        # around it, and vLLM wraps the pair anew (its own call).
        while getattr(own, "__name__", "") == ONLINE_LOADER:
            own = own.__wrapped__
        param.weight_loader = zeroing_first(loading.loader_for(suffix, own))
        online = True
    if online:
        from vllm.model_executor.model_loader.reload.layerwise import (
            initialize_online_processing,
        )

        initialize_online_processing(experts)

    quant_method = experts.quant_method
    process_weights = quant_method.process_weights_after_loading

    def process_weights_after_loading(layer: nn.Module) -> None:
        if loading.cold_start:
            loading.end_cold_start()
            process_weights(layer)
        else:
            loading.prepare_update(layer, process_weights)

    quant_method.process_weights_after_loading = process_weights_after_loading
    experts.kimi_k3_expert_loading = loading


def expert_loading(experts: nn.Module) -> StrictExpertLoading | None:
    """The strict-loading ledger of a Kimi-K3 ``RoutedExperts``, if installed."""
    return getattr(experts, "kimi_k3_expert_loading", None)


class StrictlyLoadedKimiMoE:
    """Put in front of upstream ``KimiMoE`` in the patched class's MRO."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _still_applied(type(self)):  # not if the plugin stepped aside
            config = kwargs["config"] if "config" in kwargs else args[0]
            make_expert_loading_strict(
                self,
                config.moe_intermediate_size,
                _vllm_config_of(type(self), args, kwargs),
            )


def _vllm_config_of(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The config a ``KimiMoE`` is built under, read as upstream's
    ``__init__`` reads it: NVIDIA's takes ``vllm_config`` (a ``VllmConfig``,
    or whatever stands in for one: vLLM's own unit tests pass a namespace);
    AMD's takes none (``(config, quant_config, prefix, layer_idx)``) and is
    built, as every layer, under the current config, if one is set."""
    from vllm.config import get_current_vllm_config_or_none

    parameters = inspect.signature(upstream_class(cls).__init__).parameters
    if "vllm_config" not in parameters:
        return get_current_vllm_config_or_none()
    if "vllm_config" in kwargs:
        return kwargs["vllm_config"]
    position = list(parameters).index("vllm_config") - 1  # after self
    return args[position] if position < len(args) else None


def _still_applied(cls: type) -> bool:
    """Whether the module ``cls`` is from still has this patch on its
    ``KimiMoE`` (the plugin steps aside, reverting it, where its fixes do
    not hold on the first layer's small copy: ``verification``)."""
    current = getattr(sys.modules[cls.__module__], "KimiMoE", None)
    return current is not None and issubclass(current, StrictlyLoadedKimiMoE)


def apply(upstream: ModuleType) -> None:
    """Install the patch into an imported vLLM Kimi-K3 model module (NVIDIA's
    ``nvidia/model.py``, or ``amd/linear.py`` on ROCm and XPU) (idempotent)."""
    add_subclass_layer(upstream, "KimiMoE", StrictlyLoadedKimiMoE)


def revert(upstream: ModuleType) -> None:
    """Take the patch out of upstream's ``KimiMoE`` (idempotent)."""
    remove_subclass_layer(upstream, "KimiMoE", StrictlyLoadedKimiMoE)
