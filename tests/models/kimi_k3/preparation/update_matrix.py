"""Every in-place update path x format x layout x what can happen to an update,
vLLM alone beside the plugin: one cell per combination, its verdict a short
code (``CODES``).

A GPU is built and cold-loaded with weights A (``updates.served_rank``:
vLLM's own classes on the CPU, kernels' compiled preparation stood in,
memory nobody wrote random), then a ``Scenario`` happens to it through one
of vLLM's update paths (``updates.PATHS``) with weights B, then B is sent
whole. What the layer should hold after each step (``Expected``) is judged
byte for byte against a fresh load of those weights (another random
memory), with its storage kept where vLLM keeps it. vLLM's layerwise paths
can put back what an update did not finish; its direct mode (direct
reloads, load plans) keeps nothing to go back to, by design
(``reload/direct.py``): there an update vLLM cannot prepare as sent must be
refused, and the next whole update must land.

Used by ``test_update_matrix.py`` (the cells that stand for each class) and
``python -m benchmarks.in_place_updates`` (every cell).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tests.models.kimi_k3.preparation.harness import (
    PreparationCase,
    _layer,
    _layer_topology,
)
from tests.models.kimi_k3.preparation.updates import (
    NO_FINISH,
    PATHS,
    RECEIVE_FAILS,
    DiesMidway,
    ServedRank,
    Weights,
    differences,
    has_lifecycle,
    reload_mode_of,
    served_rank,
    snapshot,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import OnlineQuantization

TP8, TP16, TP32 = Topology(8), Topology(16), Topology(32)
TP16_DP2 = Topology(16, dp_size=2)
TP8_EP = Topology(8, expert_parallel=True)
LAYOUTS = [TP8, TP16, TP32, TP16_DP2, TP8_EP]

# vLLM's update paths whose reload is layerwise (can put back what an update
# left open) or direct (writes the kernel's storage from the update's start)
DIRECT_PATHS = ("direct", "load_plan")


@dataclass(frozen=True)
class Format:
    """A format the suite builds, on a kernel: a config of
    ``kimi_k3_formats`` and ``--moe-backend``; ``online``: BF16 weights
    quantized while they load (``--quantization-config '{"moe": ...}'``)."""

    label: str
    config: str
    backend: str
    online: str | None = None
    # the paths vLLM refuses it on, alone or not: its direct reload takes no
    # online quantization (``reload/direct.py``: "online quantization is not
    # supported"), nor do load plans, which run in it
    refused_on: tuple[str, ...] = ()

    def quantization(self) -> OnlineQuantization | None:
        if self.online is None:
            return None
        return OnlineQuantization("online", json.dumps({"moe": self.online}))


FORMATS = [
    Format("mxfp4", "mxfp4", "marlin"),  # the release
    Format("fp8-block", "fp8-block", "marlin"),
    Format("nvfp4", "nvfp4", "marlin"),
    Format("int4-awq", "awq", "marlin"),  # INT4 in groups of 128
    Format(
        "bf16->fp8",
        "bf16",
        "triton",
        online="fp8_per_block",
        refused_on=("direct", "load_plan"),
    ),
]


def paths_of_this_vllm() -> list[str]:
    """The update paths the installed vLLM has: the public reload and the
    weight-transfer engines' start and finish on both releases, the rest
    vLLM 0.34's."""
    both = ("reload_weights", "start_reload")
    return [p for p in PATHS if p in both or has_lifecycle()]


def layouts_of(path: str) -> list[Topology]:
    """EPLB recovers expert-parallel layers only."""
    return [t for t in LAYOUTS if path != "eplb_recovery" or t.expert_parallel]


def ranks_of(layout: Topology) -> list[int]:
    """The first and last GPU, and the two either side of the middle (where
    whole scale groups leave the last GPUs fewer rows or none)."""
    gpus = layout.tp_size * layout.dp_size
    return sorted({0, gpus // 2 - 1, gpus // 2, gpus - 1})


# --- what can happen to an update ---------------------------------------------


@dataclass(frozen=True)
class Expected:
    """What is right after a scenario's update: whether it raises (``yes``,
    ``no``, or ``unless`` what a GPU may finish holding instead: ``unless
    B``, a GPU the broken tensor does not reach, its expert another GPU's;
    ``unless mix``, a GPU sent each of its experts whole or not at all, as
    with expert parallelism), and what the layer may hold
    then: ``B``; ``mix`` (B where ``Scenario.keeps`` says, A elsewhere);
    ``A``; ``B`` beside ``A`` where the layer had all of its share before the
    failure (vLLM finishes a layer as soon as it is whole); ``open``: still
    on ``meta``, as vLLM leaves a layer mid-update; ``-`` nothing to say
    (vLLM's direct mode keeps nothing after a refusal)."""

    raises: str
    holds: tuple[str, ...]

    @property
    def instead(self) -> str | None:
        """What a GPU may finish holding instead of raising (``unless``)."""
        unless = self.raises.startswith("unless ")
        return self.raises.removeprefix("unless ") if unless else None


def _part(name: str) -> tuple[int, str]:
    _, expert, projection, _ = name.rsplit(".", 3)
    return int(expert), projection


def only(weights: Weights, keep: Callable[[int, str], bool]) -> Weights:
    return {n: t for n, t in weights.items() if keep(*_part(n))}


def cut_short(weights: Weights) -> Weights:
    """``weights`` with its last tensor half its rows (a malformed tensor)."""
    name = list(weights)[-1]
    return {**weights, name: weights[name][: weights[name].shape[0] // 2]}


def in_buckets(weights: Weights, count: int = 3) -> list[Weights]:
    """``weights`` in ``count`` buckets whose edges fall inside an expert's
    tensors (one past each third: a weight apart from its scale, w1 from
    w3), as an engine's fixed-size buckets cut them."""
    names = list(weights)
    edges = [0, *(len(names) * k // count + 1 for k in range(1, count)), len(names)]
    return [
        {n: weights[n] for n in names[start:stop]}
        for start, stop in itertools.pairwise(edges)
    ]


def lose_parameter_bytes(served: ServedRank) -> None:
    """vLLM's level-2 sleep (``gpu_worker.sleep(level=2)``): the storage of
    every parameter is discarded and mapped again at the same address with
    undefined contents (here random bytes), buffers kept."""
    generator = torch.Generator().manual_seed(2)
    storages = {id(p.untyped_storage()): p for p in served.model.parameters()}
    for parameter in storages.values():
        storage = parameter.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        raw.copy_(
            torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator)
        )


def weight_checker_reset(served: ServedRank) -> None:
    """vLLM's weight checker's ``reset`` (``/weight_checker``, vLLM's own
    ``weight_checksum.zero_weights``): every parameter zeroed."""
    from vllm.model_executor.model_loader.weight_checksum import zero_weights

    zero_weights(served.model)


@dataclass(frozen=True)
class Scenario:
    """What happens to an update of weights B to a GPU serving A."""

    key: str  # the matrix's column
    legend: str
    sends: Callable[[Weights], list[Any]]  # B -> the buckets of the update
    layerwise: Expected
    direct: Expected
    # which of B's tensors (expert, projection) the layer holds after a
    # partial update kept the rest (``mix``)
    keeps: Callable[[int, str], bool] | None = None
    before: Callable[[ServedRank], None] | None = None  # done to the GPU first
    paths: tuple[str, ...] | None = None  # the paths it happens on (None: all)

    def expected(self, path: str) -> Expected:
        return self.direct if path in DIRECT_PATHS else self.layerwise


B = Expected("no", ("B",))
# direct mode keeps nothing: a GPU an update sent part of what it holds
# refuses it
REFUSED = Expected("unless mix", ("-",))
LOADER_PATHS = ("reload_weights", "start_reload", "direct", "load_plan")
BUCKET_PATHS = ("start_reload", "direct", "load_plan")

SCENARIOS = [
    Scenario("whole", "B whole, in one call", lambda b: [b], B, B),
    Scenario(
        "buckets",
        "B in three buckets between one start and one finish, the edges "
        "inside an expert's tensors",
        in_buckets,
        B,
        B,
        paths=BUCKET_PATHS,
    ),
    Scenario(
        "sleep 2",
        "B whole after a level-2 sleep (every parameter's bytes lost in place)",
        lambda b: [b],
        B,
        B,
        before=lose_parameter_bytes,
    ),
    Scenario(
        "reset",
        "B whole after the weight checker's reset (every parameter zeroed)",
        lambda b: [b],
        B,
        B,
        before=weight_checker_reset,
    ),
    Scenario(
        "experts",
        "B for experts 1 and 2 only: the rest kept (layerwise), refused (direct)",
        lambda b: [only(b, lambda e, p: e in (1, 2))],
        Expected("no", ("mix",)),
        REFUSED,
        keeps=lambda e, p: e in (1, 2),
        paths=LOADER_PATHS,
    ),
    Scenario(
        "w1 w3",
        "B's w1 and w3 of every expert, no w2: w2 kept (layerwise), refused (direct)",
        lambda b: [only(b, lambda e, p: p != "w2")],
        Expected("no", ("mix",)),
        REFUSED,
        keeps=lambda e, p: p != "w2",
        paths=LOADER_PATHS,
    ),
    Scenario(
        "malformed",
        "B with one tensor cut short: refused, A held (layerwise; a layer "
        "whole before the tensor arrived holds B, on a GPU without its expert "
        "without a word)",
        lambda b: [cut_short(b)],
        Expected("unless B", ("A", "B")),
        Expected("unless B", ("-",)),
    ),
    Scenario(
        "dies",
        "B's source dies midway: A held (layerwise; a layer whole before it "
        "died holds B)",
        lambda b: [DiesMidway(b, len(b) // 2)],
        Expected("yes", ("A", "B")),
        Expected("yes", ("-",)),
    ),
    Scenario(
        "recv fail",
        "the engine's receive of B's second bucket fails: A held (layerwise; a "
        "layer whole before it failed holds B)",
        lambda b: [in_buckets(b, 2)[0], RECEIVE_FAILS],
        Expected("yes", ("A", "B")),
        Expected("yes", ("-",)),
        paths=BUCKET_PATHS,
    ),
    Scenario(
        "abandoned",
        "B's first bucket, then nothing (no finish, no error): left open as "
        "vLLM leaves a layer mid-update, until the next update's start",
        lambda b: [in_buckets(b, 2)[0], NO_FINISH],
        Expected("no", ("A", "B", "open")),
        Expected("no", ("-",)),
        paths=BUCKET_PATHS,
    ),
]
SCENARIO_NAMED = {s.key: s for s in SCENARIOS}

# A cell's verdict, each code in the table and what it means
CODES = {
    "ok": "right: raised where it should, held what it should (byte for byte a "
    "fresh load of it, in the same storage), and B sent whole next landed",
    "took it": "finished where the update must be refused (a malformed "
    "tensor, or part of what direct mode cannot keep)",
    "raises": "raised where vLLM can finish",
    "meta": "left on the meta device (cannot serve until another update lands)",
    "holds A": "held the weights before the update where it should hold what was sent",
    "!= fresh": "held neither what it should nor A: not as a fresh load of it "
    "(a mixture, or pads read from memory nobody wrote)",
    "moved": "held the right bytes in other storage (CUDA graphs read the old)",
    "then ✗": "B sent whole next did not land as a fresh load of it",
    "n/a": "does not happen on this path (one call has no buckets; EPLB reloads "
    "whole layers from disk), or vLLM refuses the format there (its direct mode "
    "takes no online quantization)",
}


# --- one cell ----------------------------------------------------------------


def storage_of(experts: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each expert tensor's object and storage, as CUDA graphs hold them."""
    return {
        name: (id(t), t.data_ptr())
        for name, t in [*experts.named_parameters(), *experts.named_buffers()]
    }


def mixture(a: Weights, b: Weights, keeps: Callable[[int, str], bool]) -> Weights:
    return {n: (b if keeps(*_part(n)) else a)[n] for n in a}


# Fresh loads already taken, by what ``served_rank`` builds and loads from
# (``rows`` only labels a case), the class that builds it (the plugin's or
# vLLM alone's), and the reload mode: seeded, byte for byte the same each
# time, taken once per process.
_FRESH: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}


def fresh_load(
    kimi_model: ModuleType, case: PreparationCase, fmt: Format, weights: Any
) -> dict[str, torch.Tensor]:
    """``snapshot`` of ``case``'s GPU freshly loaded with ``weights`` (a
    version of ``weights_of``, or (version, scenario key) for a mixture)."""
    key = (
        kimi_model.KimiMoE,
        dataclasses.replace(case, rows=0),
        fmt,
        weights,
        os.environ.get("VLLM_RELOAD_MODE"),
    )
    if key not in _FRESH:
        loaded: Any = weights
        if isinstance(weights, tuple):
            layer = _layer(case.config, _layer_topology(case.topology))
            a, b = weights_of(layer, 0), weights_of(layer, weights[0])
            keeps = SCENARIO_NAMED[weights[1]].keeps
            assert keeps is not None
            loaded = mixture(a, b, keeps)
        online = fmt.quantization()
        with served_rank(kimi_model, case, loaded, online, seed=101) as served:
            _FRESH[key] = snapshot(served.experts)
    return _FRESH[key]


def forget_fresh_loads() -> None:
    _FRESH.clear()


def case_of(fmt: Format, layout: Topology, rank: int) -> PreparationCase:
    return PreparationCase(fmt.config, fmt.backend, layout, rank)


def verdict(
    kimi_model: ModuleType,
    fmt: Format,
    layout: Topology,
    rank: int,
    path: str,
    scenario: Scenario,
) -> str:
    """One GPU's verdict (a code of ``CODES``): served A, ``scenario``
    through ``path``, then B whole. Set ``VLLM_RELOAD_MODE`` for ``path``
    first (``reload_mode_of``)."""
    assert os.environ.get("VLLM_RELOAD_MODE", "layerwise") == reload_mode_of(path)
    case = case_of(fmt, layout, rank)
    expected = scenario.expected(path)
    fresh = {
        "A": fresh_load(kimi_model, case, fmt, 0),
        "B": fresh_load(kimi_model, case, fmt, 1),
    }
    if "mix" in (*expected.holds, expected.instead):
        fresh["mix"] = fresh_load(kimi_model, case, fmt, (1, scenario.key))
    with (
        update_state() as state,
        served_rank(kimi_model, case, 0, fmt.quantization(), seed=1) as served,
    ):
        storage = storage_of(served.experts)
        b = weights_of(served.layer, 1)
        if scenario.before is not None:
            scenario.before(served)
        try:
            PATHS[path](served, scenario.sends(b), state)
            raised = False
        except Exception:  # the plugin's refusal, vLLM's, the source's death
            raised = True
        on_meta = any(t.is_meta for t in served.model.parameters())
        found = None if on_meta else snapshot(served.experts)
        problem = _judged(expected, raised, found, fresh)
        if problem is None and not on_meta and path not in DIRECT_PATHS:
            problem = "moved" if storage_of(served.experts) != storage else None
        try:
            PATHS[path](served, b, state)
            landed = not differences(snapshot(served.experts), fresh["B"])
        except Exception:
            landed = False
        if problem is None and not landed:
            problem = "then ✗"
        if problem is None and path not in DIRECT_PATHS:
            problem = "moved" if storage_of(served.experts) != storage else None
    return problem or "ok"


def _judged(
    expected: Expected,
    raised: bool,
    found: dict[str, torch.Tensor] | None,
    fresh: dict[str, dict[str, torch.Tensor]],
) -> str | None:
    """What is wrong after the scenario's update (a code), or None.
    ``found``: what the experts hold (None: on ``meta``); ``fresh``: fresh
    loads of A, B and the mixture."""
    # what it holds, the expected first where two are the same bytes (a GPU
    # none of whose experts a partial update sent holds A and the mixture)
    order = [*(k for k in (*expected.holds, expected.instead) if k in fresh), *fresh]
    holds = (
        "open"
        if found is None
        else next((k for k in order if not differences(found, fresh[k])), None)
    )
    if raised and expected.raises == "no":
        return "raises"
    if not raised and (
        expected.raises == "yes"
        or (expected.instead is not None and holds != expected.instead)
    ):
        return "took it"
    if "-" in expected.holds or holds in expected.holds:
        return None
    return {"open": "meta", "A": "holds A"}.get(holds or "", "!= fresh")


def cell(
    kimi_model: ModuleType,
    fmt: Format,
    layout: Topology,
    path: str,
    scenario: Scenario,
    ranks: list[int] | None = None,
) -> str:
    """The verdict over ``ranks`` (default ``ranks_of(layout)``): the first
    wrong one's code, with the GPU, else ``ok``; ``n/a`` where the scenario
    does not happen on ``path``."""
    if path in fmt.refused_on or (
        scenario.paths is not None and path not in scenario.paths
    ):
        return "n/a"
    for rank in ranks if ranks is not None else ranks_of(layout):
        found = verdict(kimi_model, fmt, layout, rank, path, scenario)
        if found != "ok":
            return f"{found} ({rank})"
    return "ok"
