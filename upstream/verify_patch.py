"""Verify the in-tree form of the fix made for the installed vLLM release
(``upstream/vllm-{release}.patch``: 0.33.0 and 0.34.0, ``upstream.patches``)
against that vLLM, without writing into it.

    python -m upstream.verify_patch [--json] [--keep] [--jobs N]

1. Lays out a patched copy of the installed vLLM in a temporary directory
   (``upstream.patched_vllm``: links to the installed files, real copies of
   the ones the patch changes). On a vLLM release no patch is made for the
   command stops first, says so in one line on stderr, and exits 2.
   ``git apply --check`` runs next: on another vLLM than the patch's release
   the command stops there, names the file that differs in one line on
   stderr, and exits 2.
2. Lints what the patch writes as vLLM lints it (ruff, line length 88).
3. With every vLLM plugin disabled (``VLLM_PLUGINS=""``) and the copy first on
   ``PYTHONPATH``, runs the patch's own tests (``tests/models/kimi_k3/`` in
   the copy, ``--confcutdir`` as vLLM's CPU tests run) and this project's
   behaviour tests that need none of the plugin's machinery
   (``tests/upstream_patch/in_tree_behaviour.py``).
4. Dumps the format x backend x topology matrix (``upstream.partition_matrix``)
   twice: with the plugin on released vLLM, and on the patched copy without
   it (the behaviour tests' process writes that one). Every case must
   allocate the same partition (or raise the same error) and load the same
   bytes on every rank.

The installed vLLM files the patch touches are hashed before and after: they
must not change. Nor may vLLM's cache of the installed model classes: the
patched copy's processes cache under ``PATCHED_CACHE_ROOT``. Steps 3 and 4
run as separate processes, ``--jobs`` at a time.
Exit status: 0 verified, 1 a step failed, 2 the patch does not apply.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upstream.patched_vllm import (
    PatchDoesNotApply,
    PatchedCopy,
    installed_vllm_parent,
    patched_copy,
    vllm_version,
)
from upstream.patches import NoPatchForRelease, patch_for, release_of

REPO = Path(__file__).resolve().parent.parent
BEHAVIOUR_TESTS = "tests/upstream_patch/in_tree_behaviour.py"
MATRIX_OUT = "KIMI_K3_MATRIX_OUT"  # where the behaviour tests write their dump
PLUGIN = "kimi_k3_moe"  # the plugin's vllm.general_plugins entry point
STEP_TIMEOUT = 900  # seconds
# vLLM caches what it learns of a model class under VLLM_CACHE_ROOT, keyed by
# a hash of the class's package: the patched copy's Kimi-K3 package hashes
# apart from the installed one, so sharing the user's cache would overwrite
# its entry, and each side would then inspect the class again in a fresh
# process (about 15 s) at its next start. The patched copy keeps its own.
PATCHED_CACHE_ROOT = Path.home() / ".cache" / "vllm-kimi-k3-moe" / "in-tree-patch"

# B905 (zip without strict=) is not vLLM's: its own routed_experts.py, which
# the patch touches, zips without it and passes vLLM's lint.
VLLM_RUFF_CONFIG = """\
line-length = 88
[lint]
select = ["E", "F", "W", "I", "UP", "B", "SIM"]
ignore = ["B905"]
[lint.isort]
known-first-party = ["vllm"]
"""


@dataclass
class Step:
    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    log: Path
    ok: bool = False
    seconds: float = 0.0
    summary: str = ""
    output: str = field(default="", repr=False)

    def run(self) -> Step:
        start = time.monotonic()
        try:
            result = subprocess.run(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT,
                check=False,
            )
            self.ok = result.returncode == 0
            self.output = result.stdout + result.stderr
            # the step's own last word is on stdout; vLLM logs to stderr
            said = result_lines(result.stdout) or result_lines(result.stderr)
        except subprocess.TimeoutExpired as error:
            self.output = f"timed out after {error.timeout} s"
            said = [self.output]
        self.seconds = time.monotonic() - start
        self.log.write_text(self.output)
        self.summary = said[-1].strip("= ") if said else ""
        return self


def result_lines(output: str) -> list[str]:
    """The output without the warnings torch and vLLM print on a CPU box."""
    noise = ("W1", "WARNING", "INFO", "Failed to import")
    return [
        line
        for line in output.splitlines()
        if line.strip() and not line.startswith(noise)
    ]


def environment(
    pythonpath: list[Path],
    plugins: str,
    cache_root: Path | None = None,
    *,
    inherit_path: bool = True,
) -> dict[str, str]:
    """This process's environment for a step: ``pythonpath`` first (then
    this process's ``PYTHONPATH``, where ``inherit_path``)."""
    env = dict(os.environ)
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = str(cache_root)
    inherited = env.get("PYTHONPATH") if inherit_path else None
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in pythonpath] + [p for p in [inherited] if p]
    )
    env["VLLM_PLUGINS"] = plugins
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written next to linked files
    env["OMP_NUM_THREADS"] = "1"  # small tensors, a shared CPU
    return env


def file_hashes(parent: Path, paths: tuple[str, ...]) -> dict[str, str]:
    hashes = {}
    for path in paths:
        target = parent / path
        if target.is_file():
            hashes[path] = hashlib.sha256(target.read_bytes()).hexdigest()
    return hashes


def lint_steps(copy: PatchedCopy, work: Path) -> list[Step]:
    config = work / "vllm-ruff.toml"
    config.write_text(VLLM_RUFF_CONFIG)
    files = [p for p in copy.touched if p.endswith(".py")]
    env = environment([], "")
    ruff = [sys.executable, "-m", "ruff"]
    return [
        Step(
            "lint (ruff check, as vLLM)",
            [*ruff, "check", "--no-cache", "--config", str(config), *files],
            copy.root,
            env,
            work / "lint-check.log",
        ),
        Step(
            "lint (ruff format --check)",
            [*ruff, "format", "--check", "--no-cache", "--config", str(config), *files],
            copy.root,
            env,
            work / "lint-format.log",
        ),
    ]


def test_steps(copy: PatchedCopy, work: Path) -> list[Step]:
    patched = environment([copy.root, REPO], "", PATCHED_CACHE_ROOT)
    # vLLM's own tests see the copy only: this repository has a tests package,
    # which would shadow the copy's tests/ if it were on the inherited path
    patched_alone = environment([copy.root], "", PATCHED_CACHE_ROOT, inherit_path=False)
    released = environment([REPO], PLUGIN)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    patch_tests = sorted(
        p for p in copy.touched if p.startswith("tests/") and "/test_" in p
    )
    dump = [sys.executable, "-m", "upstream.partition_matrix"]
    return [
        Step(
            "matrix: plugin on released vLLM",
            [*dump, str(work / "matrix-plugin.json")],
            REPO,
            released,
            work / "matrix-plugin.log",
        ),
        Step(
            "the patch's tests (patched vLLM, no plugin)",
            [*pytest, "--confcutdir=tests/models/kimi_k3", *patch_tests],
            copy.root,
            patched_alone,
            work / "patch-tests.log",
        ),
        Step(
            "behaviour tests and matrix (patched vLLM, no plugin)",
            [*pytest, BEHAVIOUR_TESTS],
            REPO,
            {**patched, MATRIX_OUT: str(work / "matrix-patched.json")},
            work / "behaviour-tests.log",
        ),
    ]


def compare(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """One line per case where the two dumps differ (empty: the same)."""
    lines = []
    a, b = first["cases"], second["cases"]
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            lines.append(f"{key}: only in {'second' if x is None else 'first'}")
            continue
        for name in sorted(set(x) | set(y)):
            if name == "loaded_as" or x.get(name) == y.get(name):
                continue
            if name == "ranks" and name in x and name in y:
                differing = [
                    r
                    for r, (u, v) in enumerate(zip(x[name], y[name], strict=True))
                    if u != v
                ]
                lines.append(f"{key}: loaded bytes differ on ranks {differing}")
            else:
                lines.append(f"{key}: {name} {x.get(name)!r} != {y.get(name)!r}")
    return lines


# Where the two forms differ by design, each with why. At TP8 x DP4 (every
# expert split over 32 GPUs, no model-level padding) vLLM alone (0.33.0 and
# 0.34.0 alike) gives
# AutoAWQ and AutoGPTQ groups of 128 96 rows, which Marlin's check refuses,
# so it falls back to another method (MoeWNA16Method) on any non-Marlin
# kernel; the plugin keeps vLLM alone's method and kernel there (never
# another), while in tree whole groups make their own method take the
# layer (as it does at TP16 and TP32 in both forms).
INTENDED = {
    f"{fmt} | {backend} | TP8 DP4": "vLLM alone falls back to "
    f"MoeWNA16Method, which the plugin keeps; in tree whole groups keep {fmt}'s"
    for fmt, backend in (
        ("awq", "humming"),
        ("awq", "triton"),  # both refuse it, for another reason each
        ("gptq", "humming"),
        ("gptq", "triton"),  # both refuse it, for another reason each
        ("gptq", "flashinfer_trtllm"),  # likewise
    )
}


def intended(line: str) -> bool:
    return line.split(": ", 1)[0] in INTENDED


def compare_matrices(work: Path, copy: PatchedCopy) -> dict[str, Any]:
    plugin = json.loads((work / "matrix-plugin.json").read_text())
    patched = json.loads((work / "matrix-patched.json").read_text())
    problems = []
    if plugin["form"] != "plugin":
        problems.append(
            "the plugin did not load on released vLLM: install the project "
            "(pip install .) so vLLM finds its entry point"
        )
    if patched["form"] != "vllm" or Path(patched["vllm"]) != copy.root / "vllm":
        problems.append(f"the patched run imported {patched['form']} {patched['vllm']}")
    cases = patched["cases"]
    found = compare(plugin, patched)
    return {
        "cases": len(cases),
        "built": sum("error" not in case for case in cases.values()),
        "rank_loads": {
            "plugin": plugin["rank_loads"],
            "patched": patched["rank_loads"],
        },
        "differences": problems + [line for line in found if not intended(line)],
        "intended": sorted(
            {line.split(": ", 1)[0] for line in found if intended(line)}
        ),
    }


def verify(
    patch: Path, source: Path | None, jobs: int, keep: bool, report: dict[str, Any]
) -> int:
    start = time.monotonic()
    made_for = release_of(patch)  # None: a patch whose name says no release
    work = Path(tempfile.mkdtemp(prefix=f"vllm-{made_for or 'other'}-patched-"))
    source = source or installed_vllm_parent()
    report.update(patch=str(patch), work=str(work))
    try:
        try:
            copy = patched_copy(patch, work / "tree", source)
        except PatchDoesNotApply as error:
            print(error, file=sys.stderr)
            report["error"] = str(error)
            return 2
        report.update(vllm=copy.version, source=str(copy.source), touched=copy.touched)
        if made_for and copy.version != made_for:
            print(f"note: vLLM {copy.version}; the patch applies, made for {made_for}")
        before = file_hashes(copy.source, copy.touched)
        steps = lint_steps(copy, work) + test_steps(copy, work)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for step in pool.map(Step.run, steps):
                mark = "ok  " if step.ok else "FAIL"
                print(f"{mark} {step.name}: {step.summary} ({step.seconds:.0f} s)")
                if not step.ok:
                    tail = result_lines(step.output)[-25:]
                    print("\n".join("     " + line for line in tail))
        report["steps"] = {
            s.name: {"ok": s.ok, "seconds": round(s.seconds, 1), "summary": s.summary}
            for s in steps
        }
        ok = all(step.ok for step in steps)
        if ok:
            matrix = compare_matrices(work, copy)
            report["matrix"] = matrix
            differences = matrix["differences"]
            print(
                f"{'ok  ' if not differences else 'FAIL'} matrix compared: "
                f"{matrix['cases']} cases (format x backend x topology), "
                f"{matrix['built']} built, rank loads {matrix['rank_loads']}: "
                f"{len(differences)} differences, {len(matrix['intended'])} "
                "cases different by design"
            )
            for line in differences[:40]:
                print("     " + line)
            for key in matrix["intended"]:
                print(f"     by design: {key}: {INTENDED[key]}")
            ok = not differences
        if file_hashes(copy.source, copy.touched) != before:
            print("FAIL the installed vLLM files changed", file=sys.stderr)
            ok = False
        report["ok"] = ok
        return 0 if ok else 1
    finally:
        report["seconds"] = round(time.monotonic() - start, 1)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def installed_release() -> str:
    """The installed vLLM's release, as its ``_version.py`` states it (read,
    not imported: this process never imports vLLM)."""
    return vllm_version(installed_vllm_parent())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m upstream.verify_patch",
        description="Verify the in-tree patch on a patched copy of vLLM.",
    )
    parser.add_argument(
        "--patch",
        type=Path,
        help="the patch to verify (default: the one made for the installed "
        "vLLM release, upstream/vllm-RELEASE.patch)",
    )
    parser.add_argument(
        "--vllm",
        type=Path,
        help="the directory holding the vllm package to patch (default: the "
        "installed one; its files are linked, never written)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time")
    parser.add_argument("--keep", action="store_true", help="keep the copy and logs")
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    try:
        patch = args.patch or patch_for(installed_release())
    except NoPatchForRelease as error:
        print(error, file=sys.stderr)
        report["error"] = str(error)
        status = 2
    else:
        status = verify(patch.resolve(), args.vllm, args.jobs, args.keep, report)
    if args.json:
        print(json.dumps(report, indent=1))
    elif status != 2:
        print(f"{'verified' if status == 0 else 'FAILED'} in {report['seconds']} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
