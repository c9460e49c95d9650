"""In-place weight updates, vLLM alone against the plugin: for each update
path the installed vLLM has (``tests/models/kimi_k3/preparation/updates.PATHS``),
format and layout, GPUs built, cold-loaded and updated twice on the CPU as
the tests do it (kernels' preparation stood in, unwritten memory random),
with vLLM alone and with the plugin. Per cell: ``finishes`` (no error),
``= fresh`` (byte for byte what a fresh load of the same weights holds
after its kernel prepared it), ``memory-free`` (the same bytes whatever the
unwritten memory held: no pad read from it). Prints a Markdown table, and
nothing of vLLM's logs (docs/rl-and-eplb.md explains the table).

    python -m benchmarks.in_place_updates               # GPUs 0, n/2-1, n/2, n-1
    python -m benchmarks.in_place_updates --every-gpu   # all of them (slow)
    python -m benchmarks.in_place_updates --path reload_weights --format mxfp4
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os

from tests.models.kimi_k3.preparation.harness import PreparationCase
from tests.models.kimi_k3.preparation.test_in_place_updates import (
    FORMATS,
    LAYOUTS,
    UPDATES,
    _paths_of_this_vllm,
    ranks_to_update,
)
from tests.models.kimi_k3.preparation.updates import (
    PATHS,
    differences,
    reload_mode_of,
    served_rank,
    snapshot,
    update_state,
    weights_of,
)
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm
from vllm_kimi_k3_moe.tools.selftest.harness import vllm_alone


def _updated(kimi_model, case: PreparationCase, path: str, seed: int) -> list:
    """Snapshots after each update (cold start and updates with ``seed``)."""
    found = []
    with update_state() as state, served_rank(kimi_model, case, 0, seed=seed) as served:
        for version in UPDATES:
            PATHS[path](served, weights_of(served.layer, version), state)
            found.append(snapshot(served.experts))
    return found


def cell(kimi_model, cases: list[PreparationCase], path: str) -> str:
    """The verdict over ``cases`` (GPUs of one layout)."""
    fresh_wrong = memory_wrong = 0
    for case in cases:
        try:
            first = _updated(kimi_model, case, path, seed=1)
            second = _updated(kimi_model, case, path, seed=2)
        except Exception as error:  # vLLM's or the plugin's refusal, reported
            return f"fails on GPU {case.rank}: {type(error).__name__}"
        for index, version in enumerate(UPDATES):
            with served_rank(kimi_model, case, version, seed=100 + version) as fresh:
                expected = snapshot(fresh.experts)
            fresh_wrong += bool(differences(first[index], expected))
            memory_wrong += bool(differences(first[index], second[index]))
    fresh = "= fresh" if not fresh_wrong else "!= fresh"
    memory = "memory-free" if not memory_wrong else "reads unwritten memory"
    return f"finishes, {fresh}, {memory}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every-gpu", action="store_true")
    parser.add_argument("--path", action="append", help="only these update paths")
    parser.add_argument("--format", action="append", help="only these configs")
    args = parser.parse_args()

    import vllm_kimi_k3_moe

    with quiet_vllm():  # vLLM's logs to stderr, and kept off the table
        from vllm.version import __version__

        vllm_kimi_k3_moe.register()
        kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    print(f"vLLM {__version__}: vLLM alone / plugin, each update path twice")
    print("| path | format | layout | vLLM alone | plugin |")
    print("|---|---|---|---|---|")
    for path in args.path or _paths_of_this_vllm():
        os.environ["VLLM_RELOAD_MODE"] = reload_mode_of(path)
        layouts = [t for t in LAYOUTS if path != "eplb_recovery" or t.expert_parallel]
        for config, backend in FORMATS:
            if args.format and config not in args.format:
                continue
            for layout in layouts:
                gpus = layout.tp_size * layout.dp_size
                ranks = range(gpus) if args.every_gpu else ranks_to_update(layout)
                cases = [PreparationCase(config, backend, layout, r) for r in ranks]
                # vLLM's warnings (a layer an update sends nothing for logs
                # "Failed to load weights", hundreds per row) kept off the table
                with quiet_vllm(), vllm_alone(kimi_model):
                    alone = cell(kimi_model, cases, path)
                with quiet_vllm():
                    plugin = cell(kimi_model, cases, path)
                print(
                    f"| {path} | {config} | {layout.label()} | {alone} | {plugin} |",
                    flush=True,
                )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
