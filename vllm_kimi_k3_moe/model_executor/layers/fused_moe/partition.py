"""Which per-GPU layout a Kimi-K3 routed-experts layer gets, decided with vLLM's
own checks before its quantization method is built.

Used by the ``routed_experts`` patch, inside a ``KimiMoE`` build only. vLLM
0.33.0 shards every routed expert over the layer's TP x DP x PCP GPUs
(without expert parallelism; ``FusedMoEParallelConfig.make``), and several
methods check their kernel against the per-GPU partition while they are
constructed (the WNA16 oracle's Marlin check, AutoAWQ's and AutoGPTQ's
Marlin-or-fallback choice). So the layout is chosen first, by building the
method on trial layouts, and the method is then built for the layout it
will get. The trials ask vLLM, in this order:

1. what vLLM alone builds: the method for vLLM alone's partition (the
   model-level size it would have been handed, ``KimiMoEBuild``), its kernel,
   and whether the method's rule accepts that partition (vLLM alone may
   build a layer whose kernel then refuses it, or fail outright);
2. the smallest partition the method's rule accepts (its format's in the
   registry, else one learned from the method itself: ``learned_rule``) and
   its kernel keeps as it is after its weight preparation, no larger than
   what vLLM alone's kernel keeps where vLLM alone builds (than what vLLM
   alone allocates, for a method quantizing while loading: its rule is
   learned from what it quantizes to, ``online.quantized_rule``), otherwise
   no larger than the whole expert: where the even slice splits a scale group
   the GPU holds whole groups instead (``RankLayout.whole_groups``); the
   method built for it must select vLLM alone's kernel;
3. failing that, vLLM alone's layout exactly; or, where vLLM alone fails and
   nothing else builds, vLLM alone's own error.

Every trial but vLLM alone's own is built with vLLM's logging held back
(``logging_held_back``), so that the log says only what the layer does.
What the chooser asks of a method's rule and kernel (where its rule comes
from, what its kernel keeps and takes, which partitions to try) is answered
in one module beside it, ``kernel_rows``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import (
    backend_name,
    resident,
    rule_of,
    search,
)
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.online import is_online
from vllm_kimi_k3_moe.models.kimi_k3.kimi_moe import KimiMoEBuild
from vllm_kimi_k3_moe.patching import replaced_attributes


@dataclass(frozen=True)
class RankLayout:
    """The ``FusedMoEConfig`` fields a quantization method is built for: the
    layout of every expert's intermediate rows on this GPU."""

    allocated: int  # intermediate_size_per_partition
    loaded: int  # intermediate_size_per_partition_unpadded: rows filled at most
    # tp_shard_with_padding: GPU r loads rows [r*allocated, (r+1)*allocated) of
    # the checkpoint, not its even slice, so that it holds whole scale groups
    whole_groups: bool
    intermediate: int  # intermediate_size: what the layer was asked for

    def set_on(self, config: Any) -> None:
        for field, value in zip(_CONFIG_FIELDS, self._values(), strict=True):
            setattr(config, field, value)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def of(cls, config: Any) -> RankLayout:
        return cls(*(getattr(config, field) for field in _CONFIG_FIELDS))


_CONFIG_FIELDS = (
    "intermediate_size_per_partition",
    "intermediate_size_per_partition_unpadded",
    "tp_shard_with_padding",
    "intermediate_size",
)


@dataclass(frozen=True)
class PartitionChoice:
    """The per-GPU partition of one Kimi-K3 routed-experts layer."""

    method: str
    backend: str
    logical: int  # this GPU's even slice of moe_intermediate_size
    upstream: int | None  # what vLLM 0.33.0 alone allocates; None: it cannot
    allocated: int  # what this plugin allocates
    reason: str
    whole_groups: bool = False
    # why vLLM alone's partition, which it builds, its kernel cannot run
    upstream_refused: str | None = None
    # the rows vLLM alone's kernel keeps once it prepared its weights, where
    # that pads its partition again (this plugin allocates what it keeps)
    upstream_resident: int | None = None

    def log_line(self) -> str:
        alone = "cannot build" if self.upstream is None else str(self.upstream)
        if self.upstream_resident not in (None, self.upstream):
            alone += f", {self.upstream_resident} once its kernel pads them"
        return (
            f"vllm-kimi-k3-moe: Kimi-K3 routed experts on {self.method} "
            f"({self.backend}): {self.allocated} intermediate rows per GPU "
            f"(logical {self.logical}, vLLM alone {alone}); {self.reason}"
        )


@dataclass(frozen=True)
class Chosen:
    """The method built for the layout it gets, and why."""

    method: Any
    layout: RankLayout
    choice: PartitionChoice
    zero_pad_scales: bool = False


def kernel_of(method: Any) -> tuple[Any, ...]:
    """What identifies the kernel a method runs: its class, its experts
    class (the modular kernel it selected) and its backend."""
    return type(method), getattr(method, "experts_cls", None), backend_name(method)


def _hold_back(*args: Any, **kwargs: Any) -> None:
    """Stands in for vLLM's ``_print_*_once``: says nothing and, unlike
    them, remembers nothing, so the layer's own build still logs once."""


def _drop(record: logging.LogRecord) -> bool:
    """A handler filter that lets no record through."""
    return False


@contextmanager
def logging_held_back() -> Iterator[None]:
    """vLLM's log records dropped for the block, its log-once memory left
    untouched: a trial build's messages (a fallback it warns of, a kernel it
    picks) are not what the layer does."""
    import vllm.logger as vllm_logger

    once = [f"_print_{level}_once" for level in ("debug", "info", "warning", "error")]
    # A filter on the handlers that print, not ``logging.disable``: that one
    # clears every logger's level cache each time (milliseconds, for each
    # trial of each layer of a model).
    handlers = {*logging.getLogger().handlers, *logging.getLogger("vllm").handlers}
    # only those not held back already: a block inside another (a trial
    # build inside the small-layer proof) leaves the outer one's filter on
    added = [handler for handler in handlers if _drop not in handler.filters]
    with replaced_attributes(vllm_logger, **dict.fromkeys(once, _hold_back)):
        for handler in added:
            handler.addFilter(_drop)
        try:
            yield
        finally:
            for handler in added:
                handler.removeFilter(_drop)


# Why an online method keeps vLLM alone's partition (``plan`` says it too).
ONLINE_NOT_LEARNED = (
    "quantized while loading (online), not learned from what it "
    "quantizes to: vLLM alone's partition"
)


def _no_rule(method: Any) -> str:
    """Why ``method`` keeps vLLM alone's partition (it has no rule)."""
    if is_online(method):
        return ONLINE_NOT_LEARNED
    return "no rule for this method: vLLM alone's partition"


def _quietly(candidates: Iterator[int]) -> Iterator[int]:
    """``candidates`` drawn with vLLM's logging held back (the checks a rule
    calls may warn of a pad the plugin's partition then avoids), handed out
    outside it."""
    while True:
        with logging_held_back():
            n = next(candidates, None)
        if n is None:
            return
        yield n


@dataclass(frozen=True)
class Trial:
    """A method built for one layout, or the error vLLM raised building it.
    ``layout`` is what the method's constructor left in the config: some
    constructors pad the partition themselves (native FP8 with an explicit
    ``--moe-backend`` rounds to whole blocks, ``pad_tp_shard_to_weight_blocks``),
    and the method is only right for the layout it made."""

    layout: RankLayout
    method: Any = None
    error: Exception | None = None

    @property
    def built(self) -> bool:
        return self.error is None


class LayoutChooser:
    """Builds the quantization method of one routed-experts layer, being
    built for ``build``, with ``make_method()`` (vLLM's own, reading the
    layer's ``config``) for the layout it chooses."""

    def __init__(
        self, config: Any, build: KimiMoEBuild, make_method: Callable[[], Any]
    ) -> None:
        self.config = config
        self.make_method = make_method
        self.gpus = config.moe_parallel_config.tp_size  # TP x DP x PCP, no EP
        self.intermediate = config.intermediate_size
        self.logical = config.intermediate_size_per_partition
        self.hidden = config.hidden_dim
        model_level = build.model_level_size or self.intermediate
        alone = model_level // self.gpus
        self.alone_layout = RankLayout(alone, alone, False, model_level)
        self.upstream_resident: int | None = None  # known once a rule says

    def trial(self, layout: RankLayout, quiet: bool = True) -> Trial:
        """Build the method for ``layout``, leaving the config as it was."""
        before = RankLayout.of(self.config)
        layout.set_on(self.config)
        try:
            with logging_held_back() if quiet else nullcontext():
                method = self.make_method()
            return Trial(RankLayout.of(self.config), method)
        except Exception as error:  # vLLM's refusal, kept as the reason
            return Trial(layout, error=error)
        finally:
            before.set_on(self.config)

    def round_up(self, method: Any, n: int) -> int:
        """The method's own rounding of a partition of ``n`` rows."""
        return method.maybe_roundup_sizes(
            self.hidden, n, self.config.in_dtype, self.config.moe_parallel_config
        )[1]

    def choose(self) -> Chosen:
        alone = self.trial(self.alone_layout, quiet=False)  # as vLLM alone logs
        if self.gpus == 1 and self.alone_layout.allocated == self.intermediate:
            # nothing split nor padded: no layout to choose (a model that pads
            # under expert parallelism, vLLM's AMD one, has a whole expert to
            # unpad: the search below)
            return self._keep(alone, "nothing split: as vLLM alone")
        reference = alone
        if not alone.built:  # learn the format from the unsplit expert
            whole = self.intermediate
            reference = self.trial(RankLayout(whole, whole, False, whole))
        if not reference.built:
            return self._keep(alone, "vLLM alone's error")
        method = reference.method
        with logging_held_back():  # an online method is run to learn its rule
            rule = rule_of(method, self.config)
        if rule is None:
            return self._keep(alone, _no_rule(method))
        upstream = limit = refused = None
        if alone.built:
            upstream = self.round_up(method, alone.layout.allocated)
            if rule.accepts is None or rule.accepts(method, self.hidden, upstream):
                # never more than vLLM alone keeps, where it runs
                with logging_held_back():
                    limit = resident(rule, method, upstream)
                self.upstream_resident = limit
                if not rule.groups_in_checkpoint:
                    # quantized while loading: never more than vLLM alone
                    # allocates (what its kernel pads that to is not shown
                    # to be what the plugin's allocation prepares to)
                    limit = upstream
            else:
                refused = f"its kernel cannot run {upstream} rows ({rule.name})"
        limit = limit or self.intermediate
        rounded = functools.partial(self.round_up, method)
        whole_groups, group, candidates = search(
            rule, method, self.hidden, self.logical, limit, rounded
        )
        for n in _quietly(candidates):
            layout = RankLayout(
                n, n if whole_groups else self.logical, whole_groups, self.intermediate
            )
            trial = self.trial(layout)
            if not trial.built or (
                alone.built and kernel_of(trial.method) != kernel_of(alone.method)
            ):
                continue
            if not alone.built:  # its kernel's messages are the layer's own
                trial = self.trial(layout, quiet=False)
            return self._chosen(trial, upstream, rule, whole_groups, group, refused)
        return self._keep(alone, f"nothing smaller is accepted ({rule.name})")

    def as_vllm_alone(self) -> Any:
        """The method vLLM alone builds, its layout set on the config, or
        vLLM alone's error (nothing of the plugin's on it)."""
        alone = self.trial(self.alone_layout, quiet=False)
        if not alone.built:
            raise alone.error
        alone.layout.set_on(self.config)
        return alone.method

    def _keep(self, alone: Trial, reason: str) -> Chosen:
        """vLLM alone's layout exactly (or its error)."""
        if not alone.built:
            raise alone.error
        allocated = self.round_up(alone.method, alone.layout.allocated)
        choice = self._choice(
            alone.method,
            allocated,
            allocated,
            reason,
            whole_groups=alone.layout.whole_groups,
        )
        return Chosen(alone.method, alone.layout, choice)

    def _chosen(
        self,
        trial: Trial,
        upstream: int | None,
        rule: Any,
        whole_groups: bool,
        group: int,
        refused: str | None,
    ) -> Chosen:
        reason = f"smallest partition accepted ({rule.name})"
        if refused is not None:
            reason += f"; vLLM alone's: {refused}"
        if whole_groups:
            reason += f"; whole {group}-row groups per GPU, {self._rows(trial)}"
        choice = self._choice(
            trial.method,
            upstream,
            trial.layout.allocated,
            reason,
            whole_groups=whole_groups,
            upstream_refused=refused,
        )
        return Chosen(trial.method, trial.layout, choice, rule.zero_pad_scales)

    def _rows(self, trial: Trial) -> str:
        n = trial.layout.allocated
        start = min(self.config.moe_parallel_config.tp_rank * n, self.intermediate)
        end = min(start + n, self.intermediate)
        return f"this GPU rows {start}-{end - 1}" if end > start else "this GPU none"

    def _choice(
        self,
        method: Any,
        upstream: int | None,
        allocated: int,
        reason: str,
        *,
        whole_groups: bool = False,
        upstream_refused: str | None = None,
    ) -> PartitionChoice:
        return PartitionChoice(
            method=type(method).__name__,
            backend=backend_name(method),
            logical=self.logical,
            upstream=upstream,
            allocated=allocated,
            reason=reason,
            whole_groups=whole_groups,
            upstream_refused=upstream_refused,
            upstream_resident=self.upstream_resident,
        )
