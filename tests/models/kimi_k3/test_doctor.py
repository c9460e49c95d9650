"""``vllm-kimi-k3-moe doctor`` answers as vLLM's plugin loader does under each
``VLLM_PLUGINS``, says why it is off, and names the log line a real build of
Kimi-K3's MoE layer logs."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

from tests.fixes_on import lacking
from vllm_kimi_k3_moe.tools.cli import doctor, main
from vllm_kimi_k3_moe.tools.cli.version import code_fingerprint
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

UNSET = None
# (VLLM_PLUGINS, whether vLLM loads the plugin, words of doctor's answer)
SETTINGS = [
    (UNSET, True, ["unset", "ON "]),
    ("kimi_k3_moe", True, ["ON "]),
    ("lora_filesystem_resolver,kimi_k3_moe", True, ["ON "]),
    (
        "lora_filesystem_resolver",
        False,
        [
            "does not name kimi_k3_moe",
            "VLLM_PLUGINS=lora_filesystem_resolver,kimi_k3_moe",
        ],
    ),
    ("", False, ["names no plugin", "VLLM_PLUGINS=kimi_k3_moe"]),
    # vLLM splits at commas and strips nothing
    (
        "lora_filesystem_resolver, kimi_k3_moe",
        False,
        [
            "' kimi_k3_moe'",
            "strips",
            "VLLM_PLUGINS=lora_filesystem_resolver,kimi_k3_moe, or",
        ],
    ),
    ("KIMI_K3_MOE", False, ["'KIMI_K3_MOE', not 'kimi_k3_moe'"]),
]


def environment(plugins: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    return env


@pytest.mark.parametrize(("plugins", "loaded", "words"), SETTINGS)
def test_doctor_answers_as_vllms_loader(plugins, loaded, words) -> None:
    diagnosis = doctor.diagnose(environment(plugins))
    assert diagnosis.loaded is loaded
    text = "\n".join(diagnosis.lines)
    for word in words:
        assert word in text
    assert diagnosis.lines[-1].startswith("ON " if loaded else "OFF ")
    assert max(map(len, diagnosis.lines)) <= 120


@pytest.mark.parametrize(("plugins", "loaded", "_"), SETTINGS)
def test_the_reasons_restate_vllms_rule(monkeypatch, plugins, loaded, _) -> None:
    """``allowed_by``, which words the reasons, agrees with vLLM's own
    loader (``load_plugins_by_group``, which reads VLLM_PLUGINS when called)."""
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    by_vllm = doctor.ENTRY_POINT in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert by_vllm is loaded
    assert doctor.allowed_by(environment(plugins)) is by_vllm


def test_doctor_exit_status_follows_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert main(["doctor"]) == 1
    off = capsys.readouterr().out
    monkeypatch.delenv("VLLM_PLUGINS")
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out != off


def test_doctor_prints_the_version_and_the_code_fingerprint() -> None:
    """Nodes are compared by these two lines."""
    lines = doctor.diagnose(environment(UNSET)).lines
    version = importlib.metadata.version("vllm-kimi-k3-moe")
    assert lines[0].startswith(f"plugin       vllm-kimi-k3-moe {version};")
    assert lines[1].startswith(f"code         {code_fingerprint()} ")


def test_a_quiet_log_level_is_said(monkeypatch) -> None:
    env = environment(UNSET) | {"VLLM_LOGGING_LEVEL": "warning"}
    assert "hides it" in "\n".join(doctor.diagnose(env).lines)


def test_the_log_line_is_what_a_real_build_logs(build_kimi_moe) -> None:
    """doctor's example is the start of the line the plugin logs for a real
    ``KimiMoE`` at TP32 (MXFP4 on Marlin: 128 rows)."""
    moe = build_kimi_moe(Topology(32))
    line = moe.experts.routed_experts.kimi_k3_partition.log_line()
    assert line.startswith(doctor.LOG_LINE)
    assert line.startswith(doctor.LOG_EXAMPLE.removesuffix(" ..."))


# doctor in a new process: its answer, and whether torch's compiler (what
# vLLM's package initialiser imports) was imported
DOCTOR_ALONE = """
import sys
from vllm_kimi_k3_moe.tools.cli import doctor
print("\\n".join(doctor.diagnose().lines))
compiler = "torch._inductor" in sys.modules
print("compiler imported" if compiler else "compiler not imported")
"""


@pytest.mark.parametrize("plugins", [UNSET, "lora_filesystem_resolver"])
def test_doctor_alone_answers_as_with_vllm_imported(plugins) -> None:
    """In its own process doctor skips vLLM's package initialiser; its
    answer is the one given with vLLM imported whole (this process)."""
    import subprocess
    import sys

    import vllm  # noqa: F401  (whole, initialiser run)

    alone = subprocess.run(
        [sys.executable, "-c", DOCTOR_ALONE],
        capture_output=True,
        text=True,
        env=environment(plugins),
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert alone[-1] == "compiler not imported"
    assert alone[:-1] == doctor.diagnose(environment(plugins)).lines


def test_doctor_gives_each_fix_its_verdict() -> None:
    """Fix by fix, what the plugin will do on the installed vLLM (a verified
    release: each fix on, by its code); ``tests/drift`` holds it to the
    plugin's decision on drifted vLLMs."""
    import importlib.metadata

    import vllm_kimi_k3_moe

    installed = importlib.metadata.version("vllm")
    lines = doctor.diagnose(environment(UNSET)).lines
    fixes = [
        line[13:]
        for line in lines
        if line.startswith(("fixes ", " " * 13 + "on", " " * 13 + "n/a"))
    ]
    # the NVIDIA model's fixes: this box's platform builds it (CUDA's model)
    judged = vllm_kimi_k3_moe.patches_judged_with(
        {vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL}
    )
    assert fixes == [_verdict_line(patch, installed) for patch in dict.fromkeys(judged)]


def _verdict_line(patch: str, installed: str) -> str:
    """Doctor's line for ``patch`` on a verified release: on, by its code,
    or not applicable where that release lacks what it is for."""
    name = patch.rsplit(".", 1)[-1]
    absent = lacking()
    if name in absent:
        return f"n/a {name}: nothing to patch, this vLLM has no {absent[name]}"
    return f"on  {name}: verified, the code of vLLM {installed}"
