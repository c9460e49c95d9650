"""Weight updates that are not whole and well-formed, vLLM alone against the
plugin: one GPU's Kimi-K3 MoE layer (the MXFP4 release on Marlin, GPU 31 of
TP32 and GPU 7 of TP8, 4 experts 256 wide) served with weights A, then sent
B with one tensor cut short (first or last), or B for two experts only, or
B's w1 and w3 without w2, or B in two calls of two experts each; then B
whole. Through vLLM's own update paths, on the CPU, unwritten memory random
(the test suite's harness, ``tests/models/kimi_k3/preparation``). Per cell,
what the experts hold after the update, byte for byte against fresh loads:

- ``A`` / ``B`` / ``mix``: as a fresh load of A, of B, of what was sent from
  B and the rest A's; ``other``: none of these; ``meta``: left on ``meta``;
- ``refused`` where the update raised; then ``, B lands`` where B whole, sent
  next, holds as a fresh load of B, ``, B refused`` or ``, B differs``.

    python -m benchmarks.update_failures     # from the checkout, a few minutes
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.updates import (
    PATHS,
    Weights,
    differences,
    served_rank,
    snapshot,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm
from vllm_kimi_k3_moe.tools.selftest.harness import vllm_alone

GPUS = [(Topology(32), 31), (Topology(8), 7)]


def _part(name: str) -> tuple[int, str]:
    _, expert, projection, _ = name.rsplit(".", 3)
    return int(expert), projection


def cut_short(weights: Weights, index: int) -> list[Weights]:
    name = list(weights)[index]
    return [{**weights, name: weights[name][: weights[name].shape[0] // 2]}]


def only(weights: Weights, keep: Callable[[int, str], bool]) -> Weights:
    return {n: t for n, t in weights.items() if keep(*_part(n))}


# case -> (B -> the updates sent, which of B's tensors the layer should then
# hold: the rest A's; None where the update should be refused)
CASES: dict[str, tuple[Callable[[Weights], list[Weights]], Any]] = {
    "first cut short": (lambda b: cut_short(b, 0), None),
    "last cut short": (lambda b: cut_short(b, -1), None),
    "two experts": (
        lambda b: [only(b, lambda e, p: e in (1, 2))],
        lambda e, p: e in (1, 2),
    ),
    "w1, w3 only": (
        lambda b: [only(b, lambda e, p: p != "w2")],
        lambda e, p: p != "w2",
    ),
    "two calls": (
        lambda b: [only(b, lambda e, p: e < 2), only(b, lambda e, p: e >= 2)],
        lambda e, p: True,
    ),
}


def outcome(kimi_model: Any, case: PreparationCase, path: str, name: str) -> str:
    sends, holds_b = CASES[name]
    with update_state() as state, served_rank(kimi_model, case, 0, seed=1) as served:
        a, b = weights_of(served.layer, 0), weights_of(served.layer, 1)
        fresh_a = snapshot(served.experts)
        said = ""
        try:
            for update in sends(b):
                PATHS[path](served, update, state)
        except Exception:
            said = "refused: "
        on_meta = any(t.is_meta for t in served.experts.parameters())
        held = None if on_meta else snapshot(served.experts)
        try:
            PATHS[path](served, b, state)
            then = snapshot(served.experts)
        except Exception:
            then = None
    with served_rank(kimi_model, case, 1, seed=2) as fresh:
        fresh_b = snapshot(fresh.experts)
    mixture = {n: (b if holds_b and holds_b(*_part(n)) else a)[n] for n in a}
    with served_rank(kimi_model, case, mixture, seed=3) as fresh:
        fresh_mix = snapshot(fresh.experts)
    if held is None:
        now = "meta"
    else:
        looks = {"A": fresh_a, "B": fresh_b, "mix": fresh_mix}
        now = next((k for k, v in looks.items() if not differences(held, v)), "other")
    if then is None:
        after = "B refused"
    else:
        after = "B lands" if not differences(then, fresh_b) else "B differs"
    return f"{said}{now}, {after}"


def main() -> None:
    from vllm.version import __version__

    import vllm_kimi_k3_moe

    paths = ["reload_weights"]
    from vllm.model_executor.model_loader import reload

    if hasattr(reload, "start_reload"):
        paths.append("start_reload")
    print(f"vLLM {__version__}: what a layer holds after the update, then B whole")
    print("| case | path | GPU | vLLM alone | plugin |")
    print("|---|---|---|---|---|")
    os.environ.setdefault("VLLM_RELOAD_MODE", "layerwise")
    with quiet_vllm():
        vllm_kimi_k3_moe.register()
        kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    for name in CASES:
        for path in paths:
            for layout, rank in GPUS:
                case = PreparationCase("mxfp4", "marlin", layout, rank)
                with quiet_vllm():
                    plugin = outcome(kimi_model, case, path, name)
                    with vllm_alone(kimi_model):
                        alone = outcome(kimi_model, case, path, name)
                gpu = f"{rank} of {layout.label()}"
                print(f"| {name} | {path} | {gpu} | {alone} | {plugin} |", flush=True)


if __name__ == "__main__":
    main()
