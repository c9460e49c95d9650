"""The package's shape: serving apart from the tools, no import cycle.

Read from the source: every import statement of every module, deferred ones
included, and a serving process's ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
PACKAGE = "vllm_kimi_k3_moe"
TOOLS = f"{PACKAGE}.tools"
# Heavy imports a function may defer, to keep light processes light: vLLM
# and what it brings (torch; Triton and numpy for the interpreted Triton
# stand-ins), and huggingface_hub (a few hundred ms) only where check looks a
# Hugging Face id up in its cache.
HEAVY = ("vllm", "torch", "triton", "numpy", "huggingface_hub")
HUMMING = "HUMMING_DISABLE_PARALLEL_BUILD"  # tools.cli.common.HUMMING_BACKGROUND_BUILDS


def modules() -> dict[str, Path]:
    found = {}
    for path in (REPO / PACKAGE).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """(package module imported, at function level?) for each import."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative
                base = ".".join([*name.split(".")[: -node.level], node.module])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        deferred = id(node) not in top_level and not _under_type_checking(tree, node)
        found += [(target, deferred) for target in targets]
    return found


def _under_type_checking(tree: ast.Module, node: ast.AST) -> bool:
    for statement in tree.body:
        if (
            isinstance(statement, ast.If)
            and "TYPE_CHECKING" in ast.unparse(statement.test)
            and any(node is inner for inner in ast.walk(statement))
        ):
            return True
    return False


def test_no_import_cycle_anywhere_in_the_package() -> None:
    known = modules()
    graph = {
        name: {t for t, _ in imports(name, path, known) if t in known and t != name}
        for name, path in known.items()
    }
    visiting, done, cycles = [], set(), []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            cycles.append([*visiting[visiting.index(name) :], name])
            return
        visiting.append(name)
        for target in sorted(graph[name]):
            visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert cycles == []


def test_functions_defer_only_heavy_imports() -> None:
    """A package module is imported at the top of the module that needs it;
    a function defers only the heavy ones (so a light process stays light)."""
    known = modules()
    deferred = [
        f"{name}: {target}"
        for name, path in known.items()
        for target, is_deferred in imports(name, path, known)
        if is_deferred and target.split(".")[0] not in HEAVY
    ]
    assert deferred == []


def test_serving_modules_never_import_the_tools() -> None:
    known = modules()
    # ``python -m vllm_kimi_k3_moe`` is the command line: never run in a worker
    serving = [
        name
        for name in known
        if not name.startswith(TOOLS) and name != f"{PACKAGE}.__main__"
    ]
    offending = [
        f"{name} imports {target}"
        for name in serving
        for target, _ in imports(name, known[name], known)
        if target.startswith(TOOLS)
    ]
    assert offending == []


def test_the_tools_wings_never_import_the_command_line() -> None:
    """``tools.cli`` parses arguments and prints; the wings that decide
    (``plan``, ``check``, ``selftest``, ``deployment``, ``meta_rank``) stand
    below it and import nothing from it."""
    known = modules()
    cli = f"{TOOLS}.cli"
    offending = [
        f"{name} imports {target}"
        for name in known
        if name.startswith(f"{TOOLS}.") and not name.startswith(cli)
        for target, _ in imports(name, known[name], known)
        if target == cli or target.startswith(f"{cli}.")
    ]
    assert offending == []


def _imported_both_ways(packages: list[str]) -> list[str]:
    """Each two of ``packages`` that import each other, with one import
    each way (module-level and deferred imports alike)."""
    known = modules()

    def package(name: str) -> str | None:
        return next(
            (p for p in packages if name == p or name.startswith(f"{p}.")), None
        )

    edges: dict[tuple[str, str], str] = {}
    for name, path in known.items():
        source = package(name)
        for target, _ in imports(name, path, known):
            imported = package(target)
            if source and imported and imported != source:
                edges.setdefault((source, imported), f"{name} imports {target}")
    return [
        f"{edges[a, b]}; {edges[b, a]}"
        for a, b in sorted(edges)
        if a < b and (b, a) in edges
    ]


def test_no_two_tool_packages_import_each_other() -> None:
    """The tools' packages depend one way: ``deployment`` (a deployment
    described in plain Python) below ``meta_rank`` (vLLM's model built on
    ``meta`` for it), both below ``plan``, ``check`` and ``selftest``, all
    below ``cli``."""
    packages = sorted(
        f"{TOOLS}.{path.name}"
        for path in (REPO / PACKAGE / "tools").iterdir()
        if (path / "__init__.py").exists()
    )
    assert len(packages) >= 5
    assert _imported_both_ways(packages) == []


def test_verification_and_the_patches_depend_one_way() -> None:
    """``verification`` reads vLLM's code and decides which fixes go on; the
    patches (``model_executor``) ask it, and hold the proof that runs them
    (``fused_moe.proof``): ``verification`` imports nothing of theirs."""
    packages = [f"{PACKAGE}.verification", f"{PACKAGE}.model_executor"]
    assert _imported_both_ways(packages) == []


# A vLLM worker's life with the plugin: plugins loaded, Kimi-K3's model
# imported, a KimiMoE built (here on meta, as one rank of TP32 with Marlin,
# the groups and the Marlin device check stood in inline). Then which plugin
# modules it imported, and whether humming's background builds were left on
# (the tools turn them off in their own processes only).
SERVING_PROCESS = """
import json, os, sys
from types import SimpleNamespace
import torch
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.model_executor.layers.fused_moe.experts import marlin_moe
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config
from vllm.models.kimi_k3.nvidia import model
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

def group(size):
    return SimpleNamespace(world_size=size, rank_in_group=0,
                           is_first_rank=True, is_last_rank=True)

parallel_state._TP = group(32)
for name in ("_DP", "_PCP", "_PP", "_EP"):
    setattr(parallel_state, name, group(1))
marlin_moe.MarlinExpertsBase._supports_current_device = staticmethod(lambda: True)
config = KimiLinearConfig(**json.loads(sys.argv[1]))
vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                         quant_config=Mxfp4Config())
vllm_config.kernel_config.moe_backend = "marlin"
with set_current_vllm_config(vllm_config), torch.device("meta"):
    moe = model.KimiMoE(config, vllm_config, quant_config=Mxfp4Config(),
                        prefix="model.layers.1.block_sparse_moe")
print(json.dumps({
    "partition": moe.experts.routed_experts.intermediate_size_per_partition,
    "plugin_modules": sorted(m for m in sys.modules if m.startswith("vllm_kimi")),
    "humming_builds": os.environ.get("HUMMING_DISABLE_PARALLEL_BUILD", "on"),
}))
"""


def test_a_serving_process_imports_no_tool_module() -> None:
    from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_MOE_FIELDS

    result = subprocess.run(
        [sys.executable, "-c", SERVING_PROCESS, json.dumps(KIMI_K3_MOE_FIELDS)],
        capture_output=True,
        text=True,
        cwd=REPO,  # imports this tree's package
        check=False,
        env={k: v for k, v in os.environ.items() if k != HUMMING},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["partition"] == 128  # the plugin's fix was in the build
    assert report["plugin_modules"], "the plugin was not loaded"
    assert [m for m in report["plugin_modules"] if m.startswith(TOOLS)] == []
    assert report["humming_builds"] == "on"
