"""``vllm-kimi-k3-moe doctor``: will vLLM load the plugin in this environment,
and which line of the server's log shows it did.

The verdict is vLLM's own: its plugin loader (``vllm.plugins.
load_plugins_by_group`` for the ``vllm.general_plugins`` group, what every
process ``vllm serve`` starts calls) is asked, under the current
``VLLM_PLUGINS``, which general plugins it loads; the plugin is on when the
answer holds this package's ``register``. Only the reasons printed beside a
"no" restate vLLM's rule (an entry point installed, and ``VLLM_PLUGINS``
unset or naming it among its comma-separated names); a test holds them to
the loader's answers. Imports vLLM's plugin loader without the package's
initialiser (``stand_ins.vllm_without_its_package_initialiser``: torch's
compiler is not imported), and not its model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.compat import (
    kimi_k3_platform_refusal,
    supported_vllm_series,
)
from vllm_kimi_k3_moe.tools.cli.common import quiet_vllm
from vllm_kimi_k3_moe.tools.cli.version import (
    DISTRIBUTION,
    code_fingerprint,
    installed_version,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    vllm_without_its_package_initialiser,
)

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

GROUP = "vllm.general_plugins"  # vllm.plugins.DEFAULT_PLUGINS_GROUP
ENTRY_POINT = "kimi_k3_moe"  # pyproject.toml: [project.entry-points.*]
# The start of the line each process logs once per MoE quantization method
# when it builds Kimi-K3's routed experts with the plugin (a test holds it to
# the line a real build logs).
LOG_LINE = "vllm-kimi-k3-moe: Kimi-K3 routed experts on"
LOG_EXAMPLE = f"{LOG_LINE} Mxfp4MoEMethod (marlin): 128 intermediate rows per GPU ..."
# vLLM logs at INFO unless VLLM_LOGGING_LEVEL says otherwise
HIDING_LEVELS = ("WARNING", "ERROR", "CRITICAL")
INDENT = " " * 13


def add_command(commands: Subcommands) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="whether vLLM loads the plugin under the current VLLM_PLUGINS, "
        "and the server log line that shows it is on",
        description=(
            "Ask vLLM's own plugin loader, in this environment (run it with the "
            "server's VLLM_PLUGINS), whether it loads this plugin in the "
            "processes vllm serve starts; say why not, and which line the "
            "server's log shows when the plugin is on. Imports vLLM (a few "
            "seconds), not its model."
        ),
        epilog="Exit status: 0 vLLM loads the plugin; 1 it does not (why: printed).",
    )
    doctor.set_defaults(run=run)


@dataclass(frozen=True)
class Diagnosis:
    """What ``doctor`` found."""

    loaded: bool  # vLLM's loader's answer
    lines: list[str]


def allowed_by(environment: dict[str, str]) -> bool:
    """Whether ``VLLM_PLUGINS`` in ``environment`` lets vLLM load an entry
    point named ``ENTRY_POINT``: unset, or one of its comma-separated names
    (vLLM strips nothing: ``" kimi_k3_moe"`` is another name)."""
    if "VLLM_PLUGINS" not in environment:
        return True
    return ENTRY_POINT in environment["VLLM_PLUGINS"].split(",")


def _entry_point() -> metadata.EntryPoint | None:
    for entry in metadata.entry_points(group=GROUP):
        if entry.name == ENTRY_POINT:
            return entry
    return None


def _plugins_setting(environment: dict[str, str]) -> str:
    if "VLLM_PLUGINS" not in environment:
        return "unset: vLLM loads every general plugin installed"
    value = environment["VLLM_PLUGINS"]
    names = [name for name in value.split(",") if name]
    if not names:
        return f"{value!r}: names no plugin, vLLM loads no general plugin"
    return f"{value!r}: vLLM loads only the general plugins it names"


def _why_not(
    environment: dict[str, str], entry: metadata.EntryPoint | None
) -> list[str]:
    """Why vLLM's loader left the plugin out, and what turns it on."""
    if entry is None:
        return [
            f"loaded       no: no {GROUP} entry point {ENTRY_POINT!r} in this Python",
            f"turn it on   install the package into {sys.executable}'s environment",
        ]
    if allowed_by(environment):
        return ["loaded       no: vLLM failed to load its entry point (error above)"]
    names = environment["VLLM_PLUGINS"].split(",")
    near = [name for name in names if name.strip().lower() == ENTRY_POINT]
    if near:
        why = (
            f"VLLM_PLUGINS names {near[0]!r}, not {ENTRY_POINT!r} (vLLM strips nothing)"
        )
        names = [name for name in names if name not in near]
    else:
        why = f"VLLM_PLUGINS does not name {ENTRY_POINT}"
    fix = ",".join([*(name.strip() for name in names if name.strip()), ENTRY_POINT])
    return [f"loaded       no: {why}", f"turn it on   VLLM_PLUGINS={fix}, or unset it"]


def _code_line() -> str:
    """The fingerprint of the code this Python runs: run ``doctor`` on every
    node, and the nodes whose lines match run the same plugin."""
    return (
        f"code         {code_fingerprint()} (SHA-256 of the plugin's .py files: "
        "the same on nodes that run the same plugin)"
    )


def diagnose(environment: dict[str, str] | None = None) -> Diagnosis:
    """Ask vLLM's loader (imports vLLM) under ``environment`` (default: this
    process's); the plugin's own checks of the vLLM release and platform
    follow, as ``register`` makes them."""
    environment = dict(os.environ if environment is None else environment)
    plugin = installed_version(DISTRIBUTION) or "not installed (run from source)"
    entry = _entry_point()
    lines = [
        f"plugin       {DISTRIBUTION} {plugin}"
        + (f"; entry point {entry.name} -> {entry.value} ({GROUP})" if entry else ""),
        _code_line(),
        f"vLLM         {installed_version('vllm') or 'not installed'} installed; "
        f"the plugin supports {supported_vllm_series()}",
        f"VLLM_PLUGINS {_plugins_setting(environment)}",
    ]
    with vllm_without_its_package_initialiser():
        return _asked_vllm(environment, entry, lines)


def _asked_vllm(
    environment: dict[str, str], entry: metadata.EntryPoint | None, lines: list[str]
) -> Diagnosis:
    level = environment.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    try:
        with quiet_vllm():  # imported in this process's own environment
            from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    except Exception as error:  # vLLM's import itself: the first thing to fix
        why = f"{type(error).__name__}: {error}".replace("\n", " ")
        failed = f"loaded       no: vLLM fails to import: {why}"
        return Diagnosis(False, [*lines, failed])
    saved = dict(os.environ)
    try:  # vLLM reads VLLM_PLUGINS from os.environ when it loads plugins
        os.environ.clear()
        os.environ.update(environment)
        with quiet_vllm():
            found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    loaded = found.get(ENTRY_POINT) is vllm_kimi_k3_moe.register
    if not loaded:
        return Diagnosis(
            False,
            [
                *lines,
                *_why_not(environment, entry),
                "OFF          vLLM will not load the plugin in this environment: "
                "it serves Kimi-K3 as vLLM alone does",
            ],
        )
    lines.append(
        "loaded       yes: vLLM's plugin loader (vllm.plugins."
        f"load_plugins_by_group) returns {ENTRY_POINT}'s register"
    )
    refusal = _refusal()
    if refusal is not None:
        return Diagnosis(
            False, [*lines, f"patches      none: {refusal}", "OFF          " + refusal]
        )
    fixes, nothing_patched = fix_by_fix()
    lines += fixes
    if nothing_patched is not None:
        return Diagnosis(False, [*lines, "OFF          " + nothing_patched])
    lines += [
        "server log   each vLLM process that builds Kimi-K3 logs, once per MoE "
        "quantization method:",
        f"{INDENT}{LOG_EXAMPLE}",
        f"{INDENT}without it that process runs vLLM alone's layers: a warning "
        "from vllm-kimi-k3-moe",
        f"{INDENT}says why, or the plugin was not loaded there (another "
        "VLLM_PLUGINS or Python)",
    ]
    if level in HIDING_LEVELS:
        lines.append(
            f"{INDENT}VLLM_LOGGING_LEVEL={environment['VLLM_LOGGING_LEVEL']} hides "
            "it (it is logged at INFO)"
        )
    lines.append(
        "ON           vLLM loads the plugin in every process it starts in this "
        "environment"
    )
    return Diagnosis(True, lines)


def _refusal() -> str | None:
    """What the plugin logs instead of patching: a platform that does not run
    the NVIDIA Kimi-K3 model (when vLLM imports it)."""
    with quiet_vllm():
        return kimi_k3_platform_refusal()


# --- The fixes' verdict on this vLLM (``vllm_kimi_k3_moe.verification``) ----


@functools.cache
def _fix_report() -> dict[str, Any]:
    """``verification.report`` in a child process: it imports the vLLM
    modules the patches touch (vLLM's Kimi-K3 model, ~20 s), which doctor's
    own process does not."""
    child = subprocess.run(
        [sys.executable, "-m", "vllm_kimi_k3_moe.verification.report"],
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return {"fixes": [], "line": f"could not be checked: {tail}", "failed": 1}
    return json.loads(child.stdout.strip().splitlines()[-1])


def fix_by_fix() -> tuple[list[str], str | None]:
    """The plugin's verdict on each fix for the installed vLLM, as the server
    will decide it (the lines), and the warning it will log where nothing is
    patched (else None)."""
    report = _fix_report()
    if report.get("failed"):
        return [f"fixes        {report['line']}"], report["line"]
    lines = [
        f"{'fixes' if i == 0 else '':13}{fix}" for i, fix in enumerate(report["fixes"])
    ]
    lines += [  # by other code this environment loads (vLLM's general plugins)
        f"{'replaced' if i == 0 else '':13}{what}"
        for i, what in enumerate(report.get("replaced", []))
    ]
    if report["line"] is not None and not report["nothing_patched"]:
        said = textwrap.wrap(f"server logs: {report['line']}", 120 - len(INDENT))
        lines += [INDENT + part for part in said]
    return lines, report["line"] if report["nothing_patched"] else None


def run(args: argparse.Namespace) -> int:
    print("asking vLLM's plugin loader ...", file=sys.stderr)
    diagnosis = diagnose()
    print("\n".join(diagnosis.lines))
    return 0 if diagnosis.loaded else 1
