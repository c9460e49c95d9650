"""The in-tree patch made for the installed vLLM release (upstream/vllm-0.33.0.patch
or upstream/vllm-0.34.0.patch) applies to it on a copy, passes its own tests and
this project's behaviour tests with the plugin off, and matches the plugin on
released vLLM case by case; against another vLLM it applies nothing and names
the file that differs, and on a release with no patch the command says so."""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_info_cache import seeded_cache_root
from upstream import patched_vllm, patches
from upstream.verify_patch import INTENDED, REPO, compare, installed_release
from vllm_kimi_k3_moe.compat import VERIFIED_VLLM_RELEASES

RELEASE = installed_release()
PATCH = patches.patch_for(RELEASE)
# A release no patch is made for: the one after the newest verified.
_major, _minor = VERIFIED_VLLM_RELEASES[-1].split(".")[:2]
ANOTHER_RELEASE = f"{_major}.{int(_minor) + 1}.0"

# mxfp4, ct-mxfp4, fp8-block, nvfp4, modelopt-nvfp4, w4a16, awq, gptq, bf16,
# and INT4 in asymmetric groups of 128
FORMATS = 10
BACKENDS = 23  # every --moe-backend of vLLM 0.33.0 and of 0.34.0 but auto
TOPOLOGIES = 10  # TP1, 4, 8, 12, 16, 24, 32, TP16 x DP2, TP32 EP, TP8 x DP4
KIMI_K3_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
# Kimi-K3's MoE on ROCm and XPU: the patch changes its KimiMoE the same way
KIMI_K3_AMD_MODEL = "vllm/models/kimi_k3/amd/linear.py"


def installed_record() -> dict[str, str]:
    """The installed vLLM wheel's RECORD: path -> sha256 (urlsafe base64)."""
    parent = patched_vllm.installed_vllm_parent()
    (dist_info,) = parent.glob("vllm-*.dist-info")
    with (dist_info / "RECORD").open() as record:
        return {row[0]: row[1] for row in csv.reader(record) if row[1]}


def wheel_hash(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_a_patch_for_each_verified_release():
    """The releases the plugin is verified on are those a patch is made for."""
    assert patches.patch_releases() == list(VERIFIED_VLLM_RELEASES)
    assert RELEASE in VERIFIED_VLLM_RELEASES
    assert patches.release_of(PATCH) == RELEASE
    assert ANOTHER_RELEASE not in patches.patch_releases()


def test_the_copy_links_the_installed_vllm_and_writes_only_its_own_files(tmp_path):
    copy = patched_vllm.patched_copy(PATCH, tmp_path / "tree")
    record = installed_record()
    assert copy.version == RELEASE
    assert KIMI_K3_MODEL in copy.touched
    assert KIMI_K3_AMD_MODEL in copy.touched
    for path in copy.touched:
        target = copy.root / path
        assert target.is_file()
        assert not target.is_symlink()
        assert copy.root in target.resolve().parents
        if path.startswith("vllm/"):
            assert wheel_hash(target) != record[path], f"{path} was not patched"
            # the installed file is still the wheel's
            assert wheel_hash(copy.source / path) == record[path], path
    linked = copy.root / "vllm" / "config"
    assert linked.is_symlink()
    assert linked.resolve() == (copy.source / "vllm" / "config").resolve()


def kimi_moe_init(model: Path) -> ast.FunctionDef:
    """``KimiMoE.__init__`` as ``model`` (a Kimi-K3 model file) defines it."""
    tree = ast.parse(model.read_text())
    (moe,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KimiMoE"
    ]
    (init,) = [n for n in moe.body if getattr(n, "name", None) == "__init__"]
    return init


def factory_sizes(init: ast.FunctionDef) -> list[str]:
    """What ``init`` passes ``FusedMoEFactory`` as ``intermediate_size``."""
    return [
        ast.unparse(keyword.value)
        for call in ast.walk(init)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "FusedMoEFactory"
        for keyword in call.keywords
        if keyword.arg == "intermediate_size"
    ]


def test_the_amd_kimi_moe_hands_the_factory_the_logical_size(tmp_path):
    """vLLM's AMD/XPU ``KimiMoE`` (``amd/linear.py``), patched: the factory
    gets ``moe_intermediate_size`` (released: the model-level padded size), and
    neither the padding to 256 rows per TP rank nor the block after the
    factory (the ``w13_weight_packed`` lookup that raises at TP16 and more,
    the zeroing, the ``unpadded`` record) is left. ``padded_moe_intermediate_size``
    stays, as the logical size: the plugin relies on the name to judge this
    code (``relied_on``; in tree its AMD fix is then "already in vLLM",
    ``in_tree_behaviour``)."""
    copy = patched_vllm.patched_copy(PATCH, tmp_path / "tree")
    released = kimi_moe_init(copy.source / KIMI_K3_AMD_MODEL)
    patched = kimi_moe_init(copy.root / KIMI_K3_AMD_MODEL)
    assert factory_sizes(released) == ["self.padded_moe_intermediate_size"]
    assert factory_sizes(patched) == ["moe_intermediate_size"]
    names = {
        node.attr if isinstance(node, ast.Attribute) else node.value
        for node in ast.walk(patched)
        if isinstance(node, (ast.Attribute, ast.Constant))
    }
    gone = {
        "min_moe_intermediate_per_partition",
        "w13_weight_packed",
        "intermediate_size_per_partition_unpadded",
    }
    assert not names & gone
    assert "padded_moe_intermediate_size" in names
    (assigned,) = [
        node.value
        for node in ast.walk(patched)
        if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "self.padded_moe_intermediate_size"
    ]
    assert ast.unparse(assigned) == "moe_intermediate_size"


def fake_vllm(tmp_path: Path, version: str, edit: str | None) -> Path:
    """A directory holding a ``vllm`` package of the files the patch touches,
    copied from the installed one; ``edit`` one of them as another release
    would have it."""
    source = patched_vllm.installed_vllm_parent()
    parent = tmp_path / "other-vllm"
    for path in patched_vllm.patch_paths(PATCH, tmp_path):
        if not path.startswith("vllm/"):
            continue
        target = parent / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((source / path).read_bytes())
    (parent / "vllm" / "_version.py").write_text(
        f"__version__ = version = '{version}'\n"
    )
    if edit is not None:
        model = parent / edit
        model.write_text(
            model.read_text().replace(
                "intermediate_size=self.padded_moe_intermediate_size,",
                "intermediate_size=self.moe_intermediate_size_for_factory,",
            )
        )
    return parent


def test_on_another_vllm_nothing_is_applied(tmp_path):
    other = fake_vllm(tmp_path, ANOTHER_RELEASE, edit=KIMI_K3_MODEL)
    root = tmp_path / "tree"
    with pytest.raises(patched_vllm.PatchDoesNotApply) as refused:
        patched_vllm.patched_copy(PATCH, root, other)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{KIMI_K3_MODEL} differs from vLLM {RELEASE}'s" in message
    assert f"vLLM {ANOTHER_RELEASE} at" in message
    # git apply --check failed first: every copied file is still the source's
    for path in patched_vllm.patch_paths(PATCH, tmp_path):
        if path.startswith("vllm/"):
            assert (root / path).read_bytes() == (other / path).read_bytes()
        else:
            assert not (root / path).exists()


def verify_patch(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m upstream.verify_patch ARGS`` from the repository, as a user
    runs it (this process's environment unless ``env``)."""
    return subprocess.run(
        [sys.executable, "-m", "upstream.verify_patch", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_command_says_which_file_differs_in_one_line(tmp_path):
    other = fake_vllm(tmp_path, ANOTHER_RELEASE, edit=KIMI_K3_MODEL)
    result = verify_patch("--vllm", str(other))
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    # the patch is the installed release's; the vLLM patched, another one
    assert line.startswith(f"{PATCH.name} does not apply to vLLM {ANOTHER_RELEASE}")
    assert KIMI_K3_MODEL in line


def test_the_command_stops_in_one_line_on_a_release_with_no_patch(tmp_path):
    """A vLLM that is neither release (only its version file, first on the
    path): no patch to verify, nothing is laid out or run."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text(
        f"__version__ = version = '{ANOTHER_RELEASE}'\n"
    )
    result = verify_patch(
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    )
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"no in-tree patch for vLLM {ANOTHER_RELEASE} ")
    assert all(f"vllm-{r}.patch" in line for r in VERIFIED_VLLM_RELEASES)


def test_compare_names_each_case_that_differs():
    first = {
        "cases": {
            "a": {"partition": 128, "ranks": ["x", "y"], "loaded_as": "marlin"},
            "b": {"error": "ValueError: no"},
        }
    }
    second = {
        "cases": {
            "a": {"partition": 128, "ranks": ["x", "z"], "loaded_as": "triton"},
            "b": {"partition": 96, "ranks": ["x"]},
        }
    }
    assert compare(first, first) == []
    assert compare(first, second) == [
        "a: loaded bytes differ on ranks [1]",
        "b: error 'ValueError: no' != None",
        "b: partition None != 96",
        "b: ranks None != ['x']",
    ]


def cached_kimi_k3_hash(cache_root: Path) -> tuple[str | None, str]:
    """The package hash vLLM's model-info cache under ``cache_root`` (this
    process's ``VLLM_CACHE_ROOT``) holds for Kimi-K3 (None: no entry), and the
    installed package's, both as vLLM's registry has them."""
    import importlib.util

    from vllm.model_executor.models.registry import ModelRegistry

    registered = ModelRegistry.models["KimiK3ForConditionalGeneration"]
    installed = importlib.util.find_spec(registered.module_name).origin
    assert registered._get_cache_dir().is_relative_to(cache_root)
    entry = registered._get_cache_dir() / registered._get_cache_filename()
    cached = json.loads(entry.read_text())["hash"] if entry.exists() else None
    return cached, registered._get_modelinfo_module_hash(Path(installed))


@pytest.mark.slow
def test_the_patch_is_verified_with_the_plugin_off(tmp_path, monkeypatch):
    """The whole command: lint, the patch's tests and the behaviour tests on
    the patched copy with VLLM_PLUGINS="", and the matrix compared with the
    plugin on released vLLM (6 to 9 minutes on 2 cores loaded by other jobs)."""
    # The user's vLLM cache as the command sees it, a copy of this one's with
    # the installed Kimi-K3 entry current: that entry is one file for every
    # release, whose packages hash apart, so another release's run may have
    # written it.
    cache_root = seeded_cache_root(tmp_path / "vllm-cache")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache_root))
    result = verify_patch("--json")
    report = json.loads(result.stdout[result.stdout.index("\n{") :])
    failed = {name: step for name, step in report["steps"].items() if not step["ok"]}
    assert result.returncode == 0, (failed, report.get("matrix"), result.stdout)
    assert report["vllm"] == RELEASE
    assert Path(report["patch"]) == PATCH
    matrix = report["matrix"]
    assert matrix["cases"] == FORMATS * BACKENDS * TOPOLOGIES
    assert matrix["built"] > 400
    assert matrix["differences"] == []
    # only where vLLM alone's fallback method binds the plugin (INTENDED)
    assert matrix["intended"] == sorted(INTENDED)
    assert min(matrix["rank_loads"].values()) > 1000
    assert not Path(report["work"]).exists()  # the copy is gone
    # vLLM's cache describes the installed Kimi-K3 package only: the patched
    # copy's, which hashes apart, was cached elsewhere (PATCHED_CACHE_ROOT)
    cached, installed = cached_kimi_k3_hash(cache_root)
    assert cached in (None, installed)
