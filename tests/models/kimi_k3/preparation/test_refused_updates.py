"""A weight update the plugin refuses leaves the engine serving: served with
weights A, sent B with one tensor cut short (first or last of the update),
every tensor of the experts holds A byte for byte, in the same storage, no
layer of the model is left on ``meta``; then B whole lands as a fresh load of
B, and A again as a fresh load of A. Through vLLM's own update paths
(``updates.PATHS``), uninitialised memory random. In vLLM's direct mode, which
keeps no previous weights, the refusal says the model must not serve, and the
next whole update lands right."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.updates import (
    OTHER_FORMATS,
    PATHS,
    Weights,
    differences,
    has_lifecycle,
    reload_from_disk,
    served_rank,
    snapshot,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import OnlineQuantization

TP8, TP32 = Topology(8), Topology(32)
TP8_EP = Topology(8, expert_parallel=True)


def _paths() -> list[str]:
    """The update paths this vLLM has whose refusals differ: the layerwise
    reload's (start and finish alike), EPLB's and direct mode's (a load plan
    copies without the loaders; every path's outcome, byte for byte, is
    ``test_update_matrix``'s)."""
    return [
        path
        for path in ("reload_weights", "eplb_recovery", "direct")
        if path == "reload_weights" or has_lifecycle()
    ]


def cut_short(weights: Weights, which: str) -> Weights:
    """``weights`` with its first or last tensor (as sent) half its rows."""
    name = list(weights)[0 if which == "first" else -1]
    return {**weights, name: weights[name][: weights[name].shape[0] // 2]}


def storage_of(experts: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each expert tensor's object and storage, as CUDA graphs hold them."""
    return {
        name: (id(t), t.data_ptr())
        for name, t in [*experts.named_parameters(), *experts.named_buffers()]
    }


def refused_then_whole(
    kimi_model: Any,
    case: PreparationCase,
    path: str,
    which: str,
    online: OnlineQuantization | None = None,
) -> list[str]:
    """A, B cut short (refused), B whole, A again through ``path``: what
    went otherwise than stated in the module docstring."""
    direct = path == "direct"
    with served_rank(kimi_model, case, 1, online, seed=101) as fresh_b:
        fresh = {1: snapshot(fresh_b.experts)}
    problems = []
    with (
        update_state() as state,
        served_rank(kimi_model, case, 0, online, seed=1) as served,
    ):
        fresh[0] = snapshot(served.experts)
        storage = storage_of(served.experts)
        with pytest.raises(ValueError) as refused:
            PATHS[path](served, cut_short(weights_of(served.layer, 1), which), state)
        message = str(refused.value)
        if "language_model.layers.1.block_sparse_moe.experts." not in message:
            problems.append(f"the refusal names no tensor as sent: {message}")
        if "no restart needed" not in message:
            problems.append(f"the refusal says nothing of what to do: {message}")
        if direct:
            if "must not serve until a whole update lands" not in message:
                problems.append(f"direct mode's refusal: {message}")
        else:
            if "hold the weights they held before it" not in message:
                problems.append(f"the refusal says nothing of what is held: {message}")
            on_meta = [n for n, t in served.model.named_parameters() if t.is_meta]
            if on_meta:
                problems.append(f"left on meta after the refusal: {on_meta}")
            if wrong := differences(snapshot(served.experts), fresh[0]):
                problems.append(f"after the refusal, differs from A: {wrong}")
            if storage_of(served.experts) != storage:
                problems.append("after the refusal, the experts' storage moved")
        for version in (1, 0):
            PATHS[path](served, weights_of(served.layer, version), state)
            if wrong := differences(snapshot(served.experts), fresh[version]):
                problems.append(f"then {'AB'[version]} whole differs: {wrong}")
        if storage_of(served.experts) != storage:
            problems.append("after the updates, the experts' storage moved")
    return [f"{case.label()}, {path}, {which} cut short: {p}" for p in problems]


@pytest.mark.parametrize("which", ["first", "last"])
@pytest.mark.parametrize("path", _paths())
def test_mxfp4_marlin_refused_update_then_whole_ones(
    kimi_model, reload_mode, path, which
) -> None:
    """The released checkpoint on Marlin: the last GPU of TP32 (96 rows of
    128 held) and of TP8 (the plugin changes nothing there); EPLB's
    recovery on a GPU of TP8 with expert parallelism that holds the expert
    cut short (the first GPU the first expert, the last the last)."""
    reload_mode(path)
    layouts = [(TP32, 31), (TP8, 7)]
    if path == "eplb_recovery":
        layouts = [(TP8_EP, 0 if which == "first" else 7)]
    problems = []
    for layout, rank in layouts:
        case = PreparationCase("mxfp4", "marlin", layout, rank)
        problems += refused_then_whole(kimi_model, case, path, which)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("config", "backend"), OTHER_FORMATS)
def test_every_format_refused_update_then_whole_ones(
    kimi_model, reload_mode, config, backend
) -> None:
    """FP8 in blocks, NVFP4 and INT4 in groups of 128, on the first GPU of
    TP32 (with whole groups of 128 rows, GPUs 24 to 31 hold none of FP8's and
    INT4's), through the public ``reload_weights``."""
    reload_mode("reload_weights")
    case = PreparationCase(config, backend, TP32, 0)
    problems = refused_then_whole(kimi_model, case, "reload_weights", "last")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("sent", "says"),
    [
        (lambda w: cut_short(w, "first"), "has shape"),
        (lambda w: cut_short(w, "last"), "has shape"),
        (
            lambda w: {n: t for n, t in w.items() if ".w3." not in n},
            "w13 without w3.weight_packed, w3.weight_scale",
        ),
    ],
    ids=["first cut short", "last cut short", "w1 without w3"],
)
def test_a_checkpoint_directory_is_refused_by_its_headers(
    kimi_model, reload_mode, sent, says
) -> None:
    """``reload_weights(weights_path=...)``: a directory holding a short
    tensor, or w1 without w3, is refused before any tensor is read (nothing
    on ``meta``, every expert tensor A's in the same storage), the message
    naming the shard; then the directory of B whole lands as a fresh load."""
    reload_mode("reload_weights")
    case = PreparationCase("mxfp4", "marlin", TP32, 31)
    with served_rank(kimi_model, case, 1, seed=101) as fresh_b:
        expected_b = snapshot(fresh_b.experts)
    with update_state() as state, served_rank(kimi_model, case, 0, seed=1) as served:
        a, storage = snapshot(served.experts), storage_of(served.experts)
        with pytest.raises(ValueError) as refused:
            reload_from_disk(served, sent(weights_of(served.layer, 1)), state)
        message = str(refused.value)
        assert "refused before any tensor was written, by its shard headers" in (
            message
        )
        assert says in message, message
        assert "has shape" not in says or "(in model.safetensors)" in message
        assert not [n for n, t in served.model.named_parameters() if t.is_meta]
        assert not differences(snapshot(served.experts), a)
        assert storage_of(served.experts) == storage
        reload_from_disk(served, weights_of(served.layer, 1), state)
        assert not differences(snapshot(served.experts), expected_b)
