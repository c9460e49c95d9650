"""What an RL framework's weight update does to one GPU of a Kimi-K3 server
with the plugin, on the CPU: the MoE layer GPU 31 of TP32 holds (the MXFP4
release on Marlin, 4 experts 256 wide), built and cold-loaded as vLLM's
loader does it, then updated through ``reload.inplace.reload_weights``, the
function ``LLM.collective_rpc("reload_weights", ...)`` runs in each worker;
then sent an update with a short tensor, which the plugin refuses, the same
update again whole, an update of two experts only, and one whose source dies
midway; then the engine's life around an RL step: a level-2 sleep (every
parameter's bytes lost), an update in three buckets between one start and
one finish (a weight-transfer engine's way), and vLLM's weight checker
comparing every parameter's SHA-256 with a fresh load's. After each step
every tensor the experts hold (after Marlin prepared them) is compared byte
for byte with a fresh load of the weights they should hold, whose pads the
plugin zeroed: after the refusal and after the source died, the update
before's; after the update of two experts, theirs and the others' from
before. Kernels' compiled preparation is stood in, as the test suite does
(``tests/models/kimi_k3/preparation``).

    python -m benchmarks.weight_update        # from the checkout, about a minute
"""

from __future__ import annotations

import importlib
import os
import textwrap
from collections.abc import Callable
from typing import Any

from tests.models.kimi_k3.preparation.harness import (
    PreparationCase,
    _layer,
    _layer_topology,
)
from tests.models.kimi_k3.preparation.update_matrix import (
    in_buckets,
    lose_parameter_bytes,
)
from tests.models.kimi_k3.preparation.updates import (
    PATHS,
    DiesMidway,
    SourceDied,
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
        layer = _layer(CASE.config, _layer_topology(CASE.topology))
        two, three = weights_of(layer, 2), weights_of(layer, 3)
        # update 3 sends experts 1 and 2: they hold it, the others update 2
        mixture = {n: (three if _expert(n) in (1, 2) else two)[n] for n in two}
        fresh = {}
        for version, weights in ((1, 1), (2, 2), (3, mixture), (4, 4)):
            with served_rank(kimi_model, CASE, weights, seed=100 + version) as load:
                fresh[version] = (snapshot(load.experts), digests(load.experts))
        with served_rank(kimi_model, CASE, 0, seed=1) as served:
            update = weights_of(served.layer, 1)
            lines = [f"update sends {sent(update)[0]}", *sent(update)[1:]]
            reload_weights(served, update, state)
            held = snapshot(served.experts)
            lines.append(compared("update 1", held, fresh[1][0], "them (pads zero)"))
            bad = broken(weights_of(served.layer, 2))
            said = refusal(lambda: reload_weights(served, bad, state))
            lines.append(f"update 2     {said[0]}")
            lines += said[1:]
            held = snapshot(served.experts)
            lines.append(compared("then", held, fresh[1][0], "update 1"))
            good = weights_of(served.layer, 2)
            reload_weights(served, good, state)
            held = snapshot(served.experts)
            lines.append(compared("update 2 again, whole:", held, fresh[2][0], "it"))
            reload_weights(
                served, {n: three[n] for n in three if _expert(n) in (1, 2)}, state
            )
            lines.append(
                compared(
                    "update 3, experts 1 and 2 only:",
                    snapshot(served.experts),
                    fresh[3][0],
                    "them and of update 2's experts 0 and 3",
                )
            )
            four = weights_of(served.layer, 4)
            lines += source_dies(lambda u: reload_weights(served, u, state), four)
            lines.append(
                compared("then", snapshot(served.experts), fresh[3][0], "update 3")
            )
            lose_parameter_bytes(served)
            PATHS["start_reload"](served, in_buckets(four), state)
            lines.append(
                "sleep 2      every parameter's bytes lost in place, then update 4 "
                "whole in 3"
            )
            lines.append(
                f"{'':13}buckets (start, 3 x load_weights, finish): the weight "
                "checker's SHA-256"
            )
            lines.append(
                f"{'':13}of each parameter "
                + checked(digests(served.experts), fresh[4][1])
            )
    print("\n".join(lines))


def source_dies(reload: Callable[[Weights], None], update: Weights) -> list[str]:
    """Update 4, its source dying after half its tensors: what the caller sees."""
    try:
        reload([DiesMidway(update, len(update) // 2)])
    except SourceDied as error:
        note = " ".join(getattr(error, "__notes__", ["(no note)"]))
        return textwrap.wrap(
            f"update 4     its source died ({error}); the note on the error: {note}",
            width=88,
            subsequent_indent=" " * 13,
        )
    return ["update 4     its source did not die"]


def digests(experts: Any) -> dict[str, str]:
    """What vLLM's weight checker computes per parameter (``/weight_checker``
    ``checksum``: ``weight_checksum.compute_tensor_digests``), of those an
    expert update writes (not the router's correction bias, which the
    checkpoint's router holds: vLLM's ``SKIP_LOAD_TENSORS``)."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.weight_checksum import (
        compute_tensor_digests,
    )

    return {
        name: digest
        for name, digest in compute_tensor_digests(experts).items()
        if name not in SKIP_LOAD_TENSORS
    }


def checked(found: dict[str, str], baseline: dict[str, str]) -> str:
    """The weight checker's ``compare`` against a fresh load's checksums."""
    mismatches = sorted(
        k for k in found.keys() | baseline.keys() if found.get(k) != baseline.get(k)
    )
    if mismatches:
        return f"differs from a fresh load's: {', '.join(mismatches)}"
    return f"as a fresh load of update 4 ({len(found)} of {len(baseline)} match)"


def _expert(name: str) -> int:
    return int(name.rsplit(".", 3)[1])


if __name__ == "__main__":
    main()
