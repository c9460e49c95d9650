"""What an RL framework's weight update does to one GPU of a Kimi-K3 server
with the plugin, on the CPU: the MoE layer GPU 31 of TP32 holds (the MXFP4
release on Marlin, 4 experts 256 wide), built and cold-loaded as vLLM's
loader does it, then updated through ``reload.inplace.reload_weights``, the
function ``LLM.collective_rpc("reload_weights", ...)`` runs in each worker;
then sent an update with a short tensor, which the plugin refuses, the same
update again whole, and an update of two experts only. After each step every
tensor the experts hold (after Marlin prepared them) is compared byte for
byte with a fresh load of the weights they should hold, whose pads the
plugin zeroed: after the refusal, the first update's; after the update of
two experts, theirs and the others' from before. Kernels' compiled
preparation is stood in, as the test suite does
(``tests/models/kimi_k3/preparation``).

    python -m benchmarks.weight_update        # from the checkout, about a minute
"""

from __future__ import annotations

import importlib
import os
import textwrap
from collections.abc import Callable

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

CASE = PreparationCase("mxfp4", "marlin", Topology(32), rank=31)


def sent(weights: Weights) -> list[str]:
    """What one update sends: the tensors' names, dtypes and shapes."""
    parts = [name.rsplit(".", 3) for name in weights]
    head = parts[0][0]
    experts = len({expert for _, expert, _, _ in parts})
    kinds = sorted({(projection, part) for _, _, projection, part in parts})
    lines = [f"{len(parts)} tensors, {head}.E.* for each expert E of {experts}:"]
    for projection, part in kinds:
        tensor = weights[f"{head}.0.{projection}.{part}"]
        name = f"{projection}.{part}"
        lines.append(f"{'':13}{name:20} {tensor.dtype!s:13} {list(tensor.shape)}")
    return lines


def broken(weights: Weights) -> Weights:
    """An update whose last tensor has half its rows: refused."""
    name = sorted(weights)[-1]
    return {**weights, name: weights[name][: weights[name].shape[0] // 2]}


def refusal(update: Callable[[], None]) -> list[str]:
    """What ``update`` said: the refusal's message, wrapped to fit a screen."""
    try:
        update()
    except ValueError as error:
        return textwrap.wrap(f"refused: {error}", width=88, subsequent_indent=" " * 13)
    return ["not refused"]


def compared(label: str, held: Weights, fresh: Weights, what: str) -> str:
    wrong = differences(held, fresh)
    if wrong:
        return f"{label:<12} differs from a fresh load of {what}: {', '.join(wrong)}"
    return f"{label:<12} every expert tensor as a fresh load of {what} holds it"


def main() -> None:
    import vllm_kimi_k3_moe

    os.environ.setdefault("VLLM_RELOAD_MODE", "layerwise")  # vLLM 0.34's default
    print(
        "Kimi-K3 MoE layer as GPU 31 of TP32 holds it: MXFP4 (the release) on "
        "marlin, 4 experts 256 wide, on the CPU, with the plugin"
    )
    reload_weights = PATHS["reload_weights"]
    with quiet_vllm(), update_state() as state:
        vllm_kimi_k3_moe.register()
        kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
        fresh = {}
        for version in (1, 2):
            with served_rank(kimi_model, CASE, version, seed=100 + version) as load:
                fresh[version] = snapshot(load.experts)
        with served_rank(kimi_model, CASE, 0, seed=1) as served:
            update = weights_of(served.layer, 1)
            lines = [f"update sends {sent(update)[0]}", *sent(update)[1:]]
            reload_weights(served, update, state)
            held = snapshot(served.experts)
            lines.append(compared("update 1", held, fresh[1], "them (pads zero)"))
            bad = broken(weights_of(served.layer, 2))
            said = refusal(lambda: reload_weights(served, bad, state))
            lines.append(f"update 2     {said[0]}")
            lines += said[1:]
            held = snapshot(served.experts)
            lines.append(compared("then", held, fresh[1], "update 1"))
            good = weights_of(served.layer, 2)
            reload_weights(served, good, state)
            held = snapshot(served.experts)
            lines.append(compared("update 2 again, whole:", held, fresh[2], "it"))
            three = weights_of(served.layer, 3)
            mixture = {n: (three if _expert(n) in (1, 2) else good)[n] for n in good}
            reload_weights(
                served, {n: three[n] for n in three if _expert(n) in (1, 2)}, state
            )
            held = snapshot(served.experts)
        with served_rank(kimi_model, CASE, mixture, seed=103) as load:
            lines.append(
                compared(
                    "update 3, experts 1 and 2 only:",
                    held,
                    snapshot(load.experts),
                    "them and of update 2's experts 0 and 3",
                )
            )
    print("\n".join(lines))


def _expert(name: str) -> int:
    return int(name.rsplit(".", 3)[1])


if __name__ == "__main__":
    main()
