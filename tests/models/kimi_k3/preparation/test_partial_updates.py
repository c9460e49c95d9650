"""An update that sends part of a Kimi-K3 MoE layer keeps what it did not
send: served with weights A, sent B for some experts only, or B's w1 and w3
without w2, or B over two calls, every tensor of the experts holds byte for
byte what a fresh load of the mixture holds (what was sent from B, the rest
from A), in the same storage, uninitialised memory random. What the kernel
cannot take as sent (w1 without w3) is refused with nothing of the layer
written, and the next whole update lands right. In vLLM's direct mode, which
keeps nothing of what was not sent, an update of some experts is refused at
its finish, naming what is missing, and the next whole update lands right.

vLLM alone loses what a partial update did not send: the same cases on it
end with those tensors prepared from materialised memory (zeros on 0.34)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.test_refused_updates import storage_of
from tests.models.kimi_k3.preparation.updates import (
    OTHER_FORMATS,
    PATHS,
    Weights,
    differences,
    has_lifecycle,
    served_rank,
    snapshot,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import OnlineQuantization

TP8, TP32 = Topology(8), Topology(32)


def _expert_and_projection(name: str) -> tuple[int, str]:
    _, expert, projection, _ = name.rsplit(".", 3)
    return int(expert), projection


def only(weights: Weights, keep: Callable[[int, str], bool]) -> Weights:
    """The tensors of ``weights`` whose (expert, projection) ``keep`` takes."""
    return {n: t for n, t in weights.items() if keep(*_expert_and_projection(n))}


# name -> (the updates sent, each a filter of B's tensors; what B the layer
# then holds, the rest A's)
CASES: dict[
    str, tuple[list[Callable[[int, str], bool]], Callable[[int, str], bool]]
] = {
    "two experts": ([lambda e, p: e in (1, 2)], lambda e, p: e in (1, 2)),
    "w1 and w3 only": ([lambda e, p: p != "w2"], lambda e, p: p != "w2"),
    "a layer over two calls": (
        [lambda e, p: e < 2, lambda e, p: e >= 2],
        lambda e, p: True,
    ),
}


def sent_in_parts(
    kimi_model: Any,
    case: PreparationCase,
    path: str,
    name: str,
    online: OnlineQuantization | None = None,
) -> list[str]:
    """A, then B in the parts ``CASES[name]`` sends through ``path``: what
    differs from a fresh load of the mixture; then B whole."""
    updates, holds_b = CASES[name]
    with (
        update_state() as state,
        served_rank(kimi_model, case, 0, online, seed=1) as served,
    ):
        a, b = weights_of(served.layer, 0), weights_of(served.layer, 1)
        storage = storage_of(served.experts)
        for keep in updates:
            PATHS[path](served, only(b, keep), state)
        held = snapshot(served.experts)
        moved = storage_of(served.experts) != storage
        PATHS[path](served, b, state)
        then_b = snapshot(served.experts)
    mixture = {n: (b if holds_b(*_expert_and_projection(n)) else a)[n] for n in a}
    with served_rank(kimi_model, case, mixture, online, seed=7) as fresh:
        expected = snapshot(fresh.experts)
    with served_rank(kimi_model, case, 1, online, seed=8) as fresh:
        expected_b = snapshot(fresh.experts)
    problems = []
    if wrong := differences(held, expected):
        problems.append(f"differs from a fresh load of the mixture: {wrong}")
    if moved:
        problems.append("the experts' storage moved")
    if wrong := differences(then_b, expected_b):
        problems.append(f"then B whole differs: {wrong}")
    return [f"{case.label()}, {path}, {name}: {p}" for p in problems]


LAYERWISE = ["reload_weights"] + (["start_reload"] if has_lifecycle() else [])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("path", LAYERWISE)
def test_mxfp4_marlin_partial_updates_keep_the_rest(
    kimi_model, reload_mode, path, name
) -> None:
    """The released checkpoint on Marlin, the last GPU of TP32 (96 rows of
    128 held) and of TP8."""
    reload_mode(path)
    problems = []
    for layout, rank in ((TP32, 31), (TP8, 7)):
        case = PreparationCase("mxfp4", "marlin", layout, rank)
        problems += sent_in_parts(kimi_model, case, path, name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("config", "backend"), OTHER_FORMATS)
def test_every_format_partial_updates_keep_the_rest(
    kimi_model, reload_mode, config, backend
) -> None:
    """FP8 in blocks, NVFP4 and INT4 in groups of 128 on the first GPU of
    TP32 (with whole groups of 128 rows, GPUs 24 to 31 hold none of FP8's and
    INT4's), each case, through the public ``reload_weights``."""
    reload_mode("reload_weights")
    case = PreparationCase(config, backend, TP32, 0)
    problems = []
    for name in CASES:
        problems += sent_in_parts(kimi_model, case, "reload_weights", name)
    assert not problems, "\n".join(problems)


def test_a_method_quantizing_while_it_loads_keeps_the_rest(
    kimi_model, reload_mode
) -> None:
    """BF16 trainer weights sent in part into a model quantized to FP8 in
    blocks while it loaded (``{"moe": "fp8_per_block"}``, Triton), the first
    GPU of TP32: quantized as they arrive, the rest kept."""
    reload_mode("reload_weights")
    online = OnlineQuantization("online", json.dumps({"moe": "fp8_per_block"}))
    case = PreparationCase("bf16", "triton", TP32, 0)
    problems = []
    for name in CASES:
        problems += sent_in_parts(kimi_model, case, "reload_weights", name, online)
    assert not problems, "\n".join(problems)


def refused_then_whole(
    kimi_model: Any, case: PreparationCase, path: str, keep: Callable, says: str
) -> list[str]:
    """A, then part of B the plugin refuses (saying ``says``), then B whole."""
    problems = []
    with served_rank(kimi_model, case, 1, seed=101) as fresh_b:
        expected_b = snapshot(fresh_b.experts)
    with update_state() as state, served_rank(kimi_model, case, 0, seed=1) as served:
        a = snapshot(served.experts)
        b = weights_of(served.layer, 1)
        with pytest.raises(ValueError) as refused:
            PATHS[path](served, only(b, keep), state)
        if says not in str(refused.value):
            problems.append(f"the refusal does not say {says!r}: {refused.value}")
        if path != "direct":
            if wrong := differences(snapshot(served.experts), a):
                problems.append(f"after the refusal, differs from A: {wrong}")
            on_meta = [n for n, t in served.model.named_parameters() if t.is_meta]
            if on_meta:
                problems.append(f"left on meta: {on_meta}")
        PATHS[path](served, b, state)
        if wrong := differences(snapshot(served.experts), expected_b):
            problems.append(f"then B whole differs: {wrong}")
    return [f"{case.label()}, {path}: {p}" for p in problems]


@pytest.mark.parametrize("path", LAYERWISE)
def test_w1_without_w3_is_refused_with_nothing_written(
    kimi_model, reload_mode, path
) -> None:
    """w1 and w2 of every expert, no w3: the kernel fuses w1 and w3, so the
    update is refused, naming what is missing, and the layer keeps A."""
    reload_mode(path)
    case = PreparationCase("mxfp4", "marlin", TP32, 31)
    problems = refused_then_whole(
        kimi_model,
        case,
        path,
        lambda e, p: p != "w3",
        "expert 0 without w3.weight_packed, w3.weight_scale",
    )
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not has_lifecycle(), reason="direct mode is vLLM 0.34's")
def test_direct_mode_refuses_some_experts_at_finish(kimi_model, reload_mode) -> None:
    """Direct mode keeps nothing of what was not sent: two experts only are
    refused at the finish, naming the others, and B whole lands right."""
    reload_mode("direct")
    case = PreparationCase("mxfp4", "marlin", TP32, 31)
    problems = refused_then_whole(
        kimi_model,
        case,
        "direct",
        lambda e, p: e in (1, 2),
        "nothing of experts 0, 3 for w13, w2",
    )
    assert not problems, "\n".join(problems)
