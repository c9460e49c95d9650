"""The fix proven on a small layer of the deployment, on vLLM code the plugin
was not verified against, before any layer of the model gets it.

Used by the ``routed_experts`` patch at the first Kimi-K3 routed-experts
layer a process builds, when the plugin applied its fixes on code it judged
``checked`` (not a verified release's: ``verdict``). Signatures and source
say the objects are there; only running them says the fix still does what
it must. So the layer being built is built again, small, once per GPU of its
expert split: the same class, its constructor's arguments read back from the
layer (the constructor is a target: its parameters are the verified ones),
the same quantization config, the same kernel choice, the same patched code
(the plugin's layout chooser and zero pads), on the same device, with
``EXPERTS`` experts, each GPU's copy differing only in its rank; every fresh
allocation reads as random bytes (``unwritten_memory``). Each copy is handed
every sharded checkpoint tensor of its experts in the method's format
(``formats``: shapes and dtypes, never zero) through each parameter's own
``weight_loader``. Then, for every expert tensor:

- the rows each GPU holds are a run of the checkpoint's rows, byte for byte,
  at the start of their place in the parameter (w1 and w3 each in their
  half of ``w13_*``);
- every other element is zero (a weight) or one value throughout (a scale:
  vLLM's block-aligned loader writes 1 where FP8 would divide, the plugin 0
  for INT): never the memory it was;
- over the GPUs, those runs cover every row of the checkpoint once.

Then each copy is updated in place as vLLM's layerwise reload updates a
layer (RL weight sync, EPLB): every expert parameter put on ``meta`` and
materialised anew by ``reload.meta``'s own functions (the objects that
module holds, so a replacement other code installed is what runs), on
unwritten memory, handed the same tensors through the loader it carries,
and checked the same way. This is also the proof where the code is
verified but other code replaced a target at run time (``verdict``:
``replaced at run time``): the small layers are built, loaded and updated
through whatever vLLM calls now.

What it does not prove: the kernels' own preparation and forward (the GPU's;
CI proves them on the verified releases), and, on code the plugin was not
verified on, methods quantizing while loading (their weights are on
``meta`` until vLLM's layerwise loader runs: refused here, so the plugin
steps aside). On verified code with a replaced target such a method's
copies are only materialised, loaded and checked as an update (vLLM's
layerwise loader loads them that way at the cold start too): what the
replacement can change; the quantizing is the verified release's.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kimi_k3_moe.formats.bf16 import BF16
from vllm_kimi_k3_moe.formats.layouts import (
    PARAMETER_PROJECTIONS,
    TORCH_DTYPE_NAMES,
    safetensors_dtype,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe import said_once
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import backend_name
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import is_online
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import (
    logging_held_back,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.proof.unwritten_memory import (
    RandomUnwrittenMemory,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading import (
    expert_layouts,
    expert_loading,
)

EXPERTS = 2  # experts per small layer: a second one shows the expert stride
SEED = 20261204
KEY_BYTES = 16  # of a row, to find where in the checkpoint a GPU's rows start


@contextmanager
def quietly() -> Iterator[None]:
    """vLLM's and the plugin's log lines of the small layers dropped, and the
    plugin's memory of lines said once left as it was: they are not what
    the model's layers do, which say theirs when built."""
    with said_once.forgotten_after(), logging_held_back():
        yield


class NotProven(Exception):
    """The small layer did not do what the fix must: why, in one sentence."""


@dataclass(frozen=True)
class Placed:
    """Where one GPU's rows of one checkpoint tensor landed."""

    start: int  # the checkpoint row (along the intermediate) of its first row
    rows: int  # how many rows it holds


def rebuilt(layer: Any, config: Any) -> Any:
    """``layer``'s class built anew with the arguments it was built with,
    but ``config`` (its ``FusedMoEConfig``)."""
    cls = type(layer)
    arguments = {}
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    for parameter in parameters:
        name = parameter.name
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name == "moe_config":
            arguments[name] = config
        elif hasattr(layer, name):
            arguments[name] = getattr(layer, name)
        else:
            raise NotProven(f"{cls.__name__} takes {name}, which it does not keep")
    return cls(**arguments)


def small_config(config: Any, rank: int) -> Any:
    """``config`` for a layer of ``EXPERTS`` experts on GPU ``rank`` of its
    expert split (the flattened TP x DP x PCP group vLLM's loader reads)."""
    small = copy.copy(config)
    small.moe_parallel_config = copy.copy(config.moe_parallel_config)
    small.moe_parallel_config.tp_rank = rank
    if not config.moe_parallel_config.use_ep:
        small.num_experts = EXPERTS
    small.num_local_experts = EXPERTS
    return small


def never_zero(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: Any
) -> torch.Tensor:
    """Random values of ``dtype`` whose bytes are all nonzero (a row the
    loader wrote is told from a zero pad, byte by byte). Copied into a
    parameter of the same dtype, bytes stay bytes (NaN patterns included);
    ``finite`` below where the loader converts."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    data = torch.randint(
        1, 256, (size,), generator=gen, device=device, dtype=torch.uint8
    )
    return data.view(dtype).reshape(shape)


def finite(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: Any
) -> torch.Tensor:
    """Random finite values of floating ``dtype``, none zero, of every
    exponent from 2^-8 to 2^8 (rows differ): for a checkpoint dtype the
    loader converts to the parameter's."""
    uniform = torch.rand(shape, generator=gen, device=device)
    sign = torch.randint(0, 2, shape, generator=gen, device=device) * 2 - 1
    return (torch.exp2(uniform * 16 - 8) * sign).to(dtype)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, one row per row of its dim 0."""
    return tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], -1)


def _run(held: torch.Tensor, rows: torch.Tensor) -> Placed:
    """The longest run of checkpoint ``rows`` (bytes) that ``held`` starts
    with (a narrow scale row may recur in the checkpoint: the run tells)."""
    best = Placed(0, 0)
    if not held.shape[0] or not bool(held[0].any()):
        return best
    # candidates by a few bytes (a checkpoint row is thousands), then checked
    key = min(KEY_BYTES, held.shape[1])
    starts = (rows[:, :key] == held[0, :key]).all(dim=1).nonzero().flatten()
    for start in starts.tolist():
        limit = min(held.shape[0], rows.shape[0] - start)
        same = (held[:limit] == rows[start : start + limit]).all(dim=1)
        count = int(same.int().cumprod(0).sum())
        if count > best.rows:
            best = Placed(start, count)
    return best


def _written(values: torch.Tensor, is_scale: bool) -> bool:
    """Whether ``values`` (1-D) are zero, or for a scale one value throughout:
    written by someone, not the memory they were."""
    data = values.contiguous().view(torch.uint8).reshape(values.numel(), -1)
    if not bool(data.any()):
        return True
    return is_scale and bool((data == data[:1]).all())


def placed(
    param: torch.Tensor, checkpoint: torch.Tensor, is_scale: bool, what: str
) -> Placed:
    """Where ``checkpoint``'s rows landed in ``param`` (one expert's place for
    one projection; dim 0 of both is the intermediate), everything else in
    ``param`` checked to be written (``_written``)."""
    width = checkpoint.shape[1]
    if param.shape[1] < width:
        raise NotProven(f"{what}: {tuple(param.shape)} cannot hold a checkpoint row")
    run = _run(_rows(param[:, :width]), _rows(checkpoint.to(param.dtype)))
    rest = torch.cat([param[run.rows :].flatten(), param[: run.rows, width:].flatten()])
    if rest.numel() and not _written(rest, is_scale):
        raise NotProven(
            f"{what}: past the {run.rows} checkpoint rows it holds, what the "
            "memory held (neither zero nor one value)"
        )
    return run


def covered_once(runs: list[Placed], extent: int, what: str) -> None:
    """The GPUs' runs of a checkpoint tensor's ``extent`` rows cover each row
    exactly once."""
    at = 0
    for run in sorted((r for r in runs if r.rows), key=lambda r: r.start):
        if run.start < at:
            raise NotProven(f"{what}: checkpoint row {run.start} loaded twice")
        if run.start > at:
            raise NotProven(f"{what}: checkpoint row {at} loaded by no GPU")
        at += run.rows
    if at != extent:
        raise NotProven(f"{what}: checkpoint row {at} loaded by no GPU")


@dataclass(frozen=True)
class ExpertTensor:
    """One sharded checkpoint tensor of a projection, as the format stores
    it, and the parameter it loads into."""

    name: str  # the parameter's
    param: torch.nn.Parameter
    projection: str  # w1, w3, w2
    suffix: str  # the checkpoint's
    shape: tuple[int, ...]  # the checkpoint's, one expert
    dtype: torch.dtype  # the checkpoint's
    rows_dim: int  # the intermediate's dim in the checkpoint (and per expert)
    is_scale: bool

    def place(self, expert: torch.Tensor) -> torch.Tensor:
        """Where this projection's rows go in one expert's parameter, rows
        first (w1 and w3 each have their half of ``w13_*``)."""
        place = expert.movedim(self.rows_dim, 0)
        if self.projection == "w2":
            return place
        half = place.shape[0] // 2
        return place[:half] if self.projection == "w1" else place[half:]

    def __str__(self) -> str:
        return f"{self.projection}.{self.suffix} into {self.name}"


def _dtype_of(dtypes: tuple[str, ...], param: torch.Tensor) -> torch.dtype:
    """The dtype a checkpoint stores a tensor in: the parameter's where the
    format allows it, else the format's first."""
    if not dtypes or safetensors_dtype(str(param.dtype)) in dtypes:
        return param.dtype
    return getattr(torch, TORCH_DTYPE_NAMES[dtypes[0]])


def expert_tensors(small: Any, hidden: int, intermediate: int) -> list[ExpertTensor]:
    """Every sharded checkpoint tensor of ``small``'s method's format."""
    # an online method loads the BF16 checkpoint it quantizes
    loaded = BF16 if is_online(small.quant_method) else None
    known = expert_layouts(small.quant_method, loaded)
    if known is None:
        method = type(small.quant_method).__name__
        raise NotProven(f"{method} loads no checkpoint format the plugin knows")
    tensors, checkpoint_suffixes = known
    contracts = tensors.contracts(hidden, intermediate)
    found = []
    for parameter_suffix, suffix in checkpoint_suffixes.items():
        layouts = [t for t in tensors.sharded if t.suffix == suffix]
        if not layouts:
            continue  # a per-tensor value, loaded whole by every GPU
        for stem, projections in PARAMETER_PROJECTIONS.items():
            name = f"{stem}_{parameter_suffix}"
            param = getattr(small, name, None)
            if param is None or param.dim() != 3:
                raise NotProven(f"no per-expert {name} for checkpoint {suffix}")
            for projection in projections:
                contract = contracts[projection, suffix]
                found.append(
                    ExpertTensor(
                        name,
                        param,
                        projection,
                        suffix,
                        contract.shape,
                        _dtype_of(contract.dtypes, param),
                        int((projection == "w2") != layouts[0].transposed),
                        "scale" in suffix or "zero" in suffix,
                    )
                )
    return found


def local_experts(small: Any) -> list[int]:
    """The global ids of ``small``'s experts, by local id."""
    if not small.moe_config.moe_parallel_config.use_ep:
        return list(range(EXPERTS))
    local = {}
    for expert in range(small.moe_config.num_experts):
        index = small._map_global_expert_id_to_local_expert_id(expert)
        if 0 <= index < EXPERTS:
            local[index] = expert
    return [local[index] for index in sorted(local)]


class SmallLayerProof:
    """The proof for one layer under construction (``prove``)."""

    def __init__(self, layer: Any, intermediate: int, verified_code: bool) -> None:
        self.layer = layer
        self.verified_code = verified_code
        self.intermediate = intermediate  # the checkpoint's expert width
        self.hidden = layer.moe_config.hidden_dim
        self.memory = RandomUnwrittenMemory(SEED)
        self.checkpoint: dict[tuple[int, str, str], torch.Tensor] = {}
        self.runs: dict[tuple[int, str], list[Placed]] = {}
        self.reload_runs: dict[tuple[int, str], list[Placed]] = {}
        self.extents: dict[str, int] = {}
        self.generator: torch.Generator | None = None

    def tensor(self, expert: int, tensor: ExpertTensor) -> torch.Tensor:
        """The checkpoint's ``tensor`` of ``expert`` (the same on every GPU)."""
        key = (expert, tensor.projection, tensor.suffix)
        if key not in self.checkpoint:
            device = tensor.param.device
            if device.type == "meta":  # an online layer's, until loaded
                device = torch.get_default_device()
            if self.generator is None:
                self.generator = torch.Generator(device).manual_seed(SEED + 1)
            converted = tensor.dtype != tensor.param.dtype
            floating = tensor.dtype.is_floating_point
            values = finite if converted and floating else never_zero
            self.checkpoint[key] = values(
                tensor.shape, tensor.dtype, device, self.generator
            )
        return self.checkpoint[key]

    def one_gpu(self, rank: int) -> str:
        """Build, load and check the small layer of GPU ``rank``, then update
        it in place as vLLM reloads weights; its method and kernel."""
        with self.memory:
            small = rebuilt(self.layer, small_config(self.layer.moe_config, rank))
        method = small.quant_method
        online = is_online(method)
        if online and not self.verified_code:
            raise NotProven(
                f"{type(method).__name__} quantizes while loading: its loading "
                "is not proven on a small layer"
            )
        tensors = expert_tensors(small, self.hidden, self.intermediate)
        params = {tensor.name: tensor.param for tensor in tensors}
        if not online:  # an online layer's weights are on meta until loaded
            self.load(small, tensors, params, rank, self.runs)
            loading = expert_loading(small)
            if loading is not None:  # as before the kernel's preparation
                loading.end_cold_start()
        self.load(small, tensors, self.reloaded(params), rank, self.reload_runs)
        return f"{type(method).__name__}, {backend_name(method)}"

    def reloaded(
        self, params: dict[str, torch.nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        """Each parameter as vLLM's layerwise reload gives it back to its
        loaders for an in-place update: put on ``meta`` and materialised anew
        by ``reload.meta``'s own functions (whatever that module holds now:
        another's replacement too), on unwritten memory."""
        from vllm.model_executor.model_loader.reload import meta as reload_meta

        fresh = {}
        with self.memory:
            for name, param in params.items():
                on_meta = reload_meta.to_meta_tensor(param)
                tensor = reload_meta.materialize_meta_tensor(on_meta)
                carried = vars(tensor).get("weight_loader")
                if (
                    tensor.is_meta
                    or tensor.shape != param.shape
                    or tensor.dtype != param.dtype
                    or carried is not vars(param).get("weight_loader")
                ):
                    raise NotProven(
                        f"{name} as vLLM's reload materialises it "
                        f"({tuple(tensor.shape)} {tensor.dtype} on "
                        f"{tensor.device}) is not the parameter on memory with "
                        "its weight_loader"
                    )
                fresh[name] = tensor
        return fresh

    def load(
        self,
        small: Any,
        tensors: list[ExpertTensor],
        into: dict[str, torch.Tensor],
        rank: int,
        runs: dict[tuple[int, str], list[Placed]],
    ) -> None:
        """Hand ``small``'s GPU every checkpoint tensor of its experts through
        the loader each tensor of ``into`` carries, then find where the rows
        landed (``placed``), into ``runs``."""
        experts = local_experts(small)
        with torch.no_grad():
            for tensor in tensors:
                param = into[tensor.name]
                for expert in experts:
                    param.weight_loader(
                        param,
                        self.tensor(expert, tensor),
                        f"{small.layer_name}.{tensor.name}",
                        shard_id=tensor.projection,
                        expert_id=expert,
                    )
            for tensor in tensors:
                for local, expert in enumerate(experts):
                    checkpoint = self.tensor(expert, tensor)
                    what = f"GPU {rank}, expert {expert}, {tensor}"
                    run = placed(
                        tensor.place(into[tensor.name].data[local]),
                        checkpoint.movedim(tensor.rows_dim, 0),
                        tensor.is_scale,
                        what,
                    )
                    runs.setdefault((local, str(tensor)), []).append(run)
                    self.extents[str(tensor)] = checkpoint.shape[tensor.rows_dim]

    def prove(self) -> str:
        gpus = self.layer.moe_config.moe_parallel_config.tp_size
        kernel = ""
        for rank in range(gpus):
            kernel = self.one_gpu(rank)
        for when, loads in (("", self.runs), (" updated", self.reload_runs)):
            for (local, tensor), runs in loads.items():
                what = f"expert {local}{when}, {tensor}"
                covered_once(runs, self.extents[tensor], what)
        return (
            f"proven on a small layer of this deployment ({kernel}, {gpus} "
            f"GPU{'s' * (gpus > 1)} x {EXPERTS} experts: every checkpoint row "
            "loaded once, at the cold start and updated in place, pads zero "
            "over unwritten memory)"
        )


def prove(layer: Any, intermediate: int, verified_code: bool = False) -> str:
    """Build ``layer`` (a ``RoutedExperts`` under construction, its method not
    built yet) small on each GPU of its expert split, load and check it (the
    module docstring): what was proven, in a few words; ``NotProven`` with
    why where it does not hold. ``intermediate``: the checkpoint's expert
    width (``moe_intermediate_size``)."""
    return SmallLayerProof(layer, intermediate, verified_code).prove()
