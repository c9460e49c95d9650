"""In-place weight updates, vLLM alone against the plugin: every update path
the installed vLLM has x every format the suite builds x TP8, TP16, TP32,
TP16 x DP2, TP8 with EP x what can happen to an update (whole, in buckets,
after a level-2 sleep, after the weight checker's reset, some experts, w1
and w3 only, a malformed tensor, the source dying midway, a receive failing
with nothing after). Each GPU is built, served weights A and updated on the
CPU as the tests do it (``tests/models/kimi_k3/preparation/update_matrix``:
vLLM's own classes and update code, kernels' compiled preparation stood in,
memory nobody wrote random), with vLLM alone and with the plugin, and judged
byte for byte against fresh loads. Prints one table per path and a legend;
docs/rl-and-eplb.md explains them.

    python -m benchmarks.in_place_updates                 # GPUs 0, n/2-1, n/2, n-1
    python -m benchmarks.in_place_updates --gpus first-last   # quicker
    python -m benchmarks.in_place_updates --path load_plan --format fp8-block
    python -m benchmarks.in_place_updates --format mxfp4 --layout TP32 --gpu 31

``--jobs`` worker processes share the rows (default: one per core; with 1,
this process runs them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import os
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from tests.models.kimi_k3.preparation.update_matrix import (
    CODES,
    FORMATS,
    SCENARIOS,
    cell,
    layouts_of,
    paths_of_this_vllm,
    ranks_of,
)
from tests.models.kimi_k3.preparation.updates import reload_mode_of
from vllm_kimi_k3_moe.tools.cli.common import no_background_kernel_builds
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm
from vllm_kimi_k3_moe.tools.selftest.harness import vllm_alone

# The codes as the tables print them (``CODES`` says what each means)
SHORT = {
    "ok": "ok",
    "took it": "took",
    "raises": "rais",
    "meta": "meta",
    "holds A": "A",
    "!= fresh": "!=",
    "moved": "mvd",
    "then ✗": "then",
    "n/a": "-",
}

_kimi_model: Any = None


def _import_vllm() -> None:
    """Each worker process: vLLM's Kimi-K3 model, the plugin registered."""
    global _kimi_model
    import vllm_kimi_k3_moe

    with quiet_vllm():
        vllm_kimi_k3_moe.register()
        _kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)


def _short(verdict: str) -> str:
    return SHORT[verdict.split(" (")[0]]


def row(path: str, fmt_label: str, layout: Topology, gpus: Any) -> list[str]:
    """One row's cells, ``alone|plugin`` per scenario, on the GPUs ``gpus``
    names (``--gpus``), or those of a list of numbers (``--gpu``)."""
    fmt = next(f for f in FORMATS if f.label == fmt_label)
    everyone = layout.tp_size * layout.dp_size
    if isinstance(gpus, list):
        ranks = [gpu for gpu in gpus if gpu < everyone]
    else:
        ranks = {
            "first-last": sorted({0, everyone - 1}),
            "every": list(range(everyone)),
        }.get(gpus, ranks_of(layout))
    with _reload_mode(path):
        return [_cell(path, fmt, layout, s, ranks) for s in SCENARIOS]


def _cell(
    path: str, fmt: Any, layout: Topology, scenario: Any, ranks: list[int]
) -> str:
    """``alone|plugin`` for one scenario."""
    # vLLM's warnings (a layer an update sends nothing for logs "Failed to
    # load weights", hundreds per row) kept off the table
    with quiet_vllm(), vllm_alone(_kimi_model):
        alone = cell(_kimi_model, fmt, layout, path, scenario, ranks)
    with quiet_vllm():
        plugin = cell(_kimi_model, fmt, layout, path, scenario, ranks)
    return f"{_short(alone)}|{_short(plugin)}"


@contextlib.contextmanager
def _reload_mode(path: str) -> Any:
    """``VLLM_RELOAD_MODE`` as ``path`` runs it, for the block (the docs test
    runs this module in its own process)."""
    before = os.environ.get("VLLM_RELOAD_MODE")
    os.environ["VLLM_RELOAD_MODE"] = reload_mode_of(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_RELOAD_MODE"]
        else:
            os.environ["VLLM_RELOAD_MODE"] = before


def _legend(key: str, text: str) -> None:
    print(
        "\n".join(
            textwrap.wrap(
                f"{key:<10} {text}", 86, initial_indent="  ", subsequent_indent=" " * 13
            )
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", action="append", help="only these update paths")
    parser.add_argument("--format", action="append", help="only these formats")
    parser.add_argument(
        "--gpus",
        choices=("middle", "first-last", "every"),
        default="middle",
        help="the GPUs of each layout: 0, n/2-1, n/2, n-1 (default), 0 and "
        "n-1, or all of them",
    )
    parser.add_argument("--layout", action="append", help="only these (TP32, ...)")
    parser.add_argument("--gpu", type=int, action="append", help="only these GPUs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    start = time.monotonic()
    no_background_kernel_builds()  # in the workers too

    from vllm.version import __version__

    paths = args.path or paths_of_this_vllm()
    formats = [f.label for f in FORMATS if not args.format or f.label in args.format]
    rows = [
        (path, fmt, layout)
        for path in paths
        for fmt in formats
        for layout in layouts_of(path)
        if not args.layout or layout.label().replace(" ", "") in args.layout
    ]
    gpus = args.gpu or args.gpus
    named = {
        "middle": "0, n/2-1, n/2 and n-1 of each layout's n",
        "first-last": "0 and n-1 of each layout's n",
        "every": "every GPU of each layout",
    }
    on = named.get(gpus) if isinstance(gpus, str) else ", ".join(map(str, gpus))
    print(f"vLLM {__version__}: each cell vLLM alone|the plugin, on GPUs {on}")
    with contextlib.ExitStack() as stack:
        if args.jobs > 1:
            spawn = multiprocessing.get_context("spawn")  # no fork of torch's threads
            pool = ProcessPoolExecutor(args.jobs, spawn, initializer=_import_vllm)
            mapped: Any = stack.enter_context(pool).map
        else:
            _import_vllm()
            mapped = map
        found = mapped(row, *zip(*rows, strict=True), [gpus] * len(rows))
        shown = None
        for (path, fmt, layout), cells in zip(rows, found, strict=True):
            if path != shown:
                shown = path
                print(f"\n{path}")
                header = [f"{'format':<10} {'layout':<9}"]
                print(" ".join(header + [f"{s.key:<9}" for s in SCENARIOS]).rstrip())
            label = f"{fmt:<10} {layout.label():<9}"
            print(" ".join([label, *(f"{c:<9}" for c in cells)]).rstrip(), flush=True)
    print("\ncolumns:")
    for scenario in SCENARIOS:
        _legend(scenario.key, scenario.legend)
    print("cells, vLLM alone|plugin (the first GPU found wrong decides):")
    for code, short in SHORT.items():
        _legend(short, CODES[code])
    print(f"took {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
