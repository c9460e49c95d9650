"""Copies of the installed vLLM changed as future releases change code, made
without writing into it or copying its 877 MB: ``upstream.patched_vllm.
mirror`` lays out real directories along the changed paths, real copies of
the changed files and links for everything else; the copy's root goes first
on ``PYTHONPATH``. The distribution metadata stays the installed one's: the
plugin reads the version vLLM's code states (``vllm/_version.py``).

Each case changes what a real release, nightly or fork changes:

- ``release``: 0.34.0's (or 0.33.0's) code calling itself 0.35.0.
- ``nightly-renamed``: ``0.34.1.dev57+gdeadbee`` whose ``RoutedExperts.
  _get_quant_method`` (a private method the partition patch wraps) is
  renamed, with every call of it.
- ``signature-changed``: ``DefaultModelLoader.get_all_weights`` takes one
  more argument (with a default; every caller unchanged).
- ``module-moved``: ``fused_moe/oracle/int_wna16.py`` moved to
  ``oracle/wna16.py``, every import of it rewritten.
- ``in-tree``: the in-tree patch for the release (``upstream/vllm-*.patch``)
  applied: vLLM's own layer gives the backend's partition and zero pads.
- ``nightly-commented``: a nightly whose ``RoutedExperts.__init__`` has one
  more comment: other code with every check passing, so the first layer
  built proves the fixes on a small layer (FP8 block at TP32), which holds.
- ``nightly-class-call``: a nightly whose ``RoutedExperts.__init__`` calls
  ``create_weights`` through the method's class: every check on the code
  passes, but the plugin's ``create_weights`` (zero pads, the rows held)
  is never called; the first layer's small copy (NVFP4 at TP32, allocated
  with ``torch.empty``) holds unwritten memory in its pads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from upstream import patched_vllm, patches
from vllm_kimi_k3_moe.compat import VERIFIED_VLLM_RELEASES

FUSED_MOE = "vllm/model_executor/layers/fused_moe"
ROUTED_EXPERTS = f"{FUSED_MOE}/routed_experts.py"
DEFAULT_LOADER = "vllm/model_executor/model_loader/default_loader.py"
INT_WNA16 = f"{FUSED_MOE}/oracle/int_wna16.py"
MOVED_TO = f"{FUSED_MOE}/oracle/wna16.py"
VERSION_FILE = "vllm/_version.py"

Edit = Callable[[str], str]


@dataclass(frozen=True)
class Drift:
    name: str
    version: str | None  # the version the copy states (None: the installed)
    edits: dict[str, Edit] = field(default_factory=dict)  # path -> new text
    moves: dict[str, str] = field(default_factory=dict)  # module file moved
    in_tree: bool = False  # the release's in-tree patch applied
    # "format | backend | TPn" the process builds first: the deployment whose
    # first layer proves the fixes where the code is not a verified release's
    first: str | None = None


def _next_release() -> str:
    major, minor = VERIFIED_VLLM_RELEASES[-1].split(".")[:2]
    return f"{major}.{int(minor) + 1}.0"


def _nightly() -> str:
    major, minor = VERIFIED_VLLM_RELEASES[-1].split(".")[:2]
    return f"{major}.{minor}.1.dev57+gdeadbee"


def _renamed(old: str, new: str) -> Edit:
    return lambda text: re.sub(rf"\b{old}\b", new, text)


def _one_more_argument(text: str) -> str:
    changed = re.sub(
        r"(def get_all_weights\(\s*self,\s*model_config: ModelConfig,"
        r"\s*model: nn\.Module,)",
        r"\1\n        prefetch: bool = False,",
        text,
        count=1,
    )
    assert changed != text, "get_all_weights not found"
    return changed


def _replaced(old: str, new: str) -> Edit:
    def edit(text: str) -> str:
        assert old in text, f"not in the file: {old}"
        return text.replace(old, new)

    return edit


RENAMED_BY = (ROUTED_EXPERTS, "vllm/models/deepseek_v4/amd/model.py")
GET_METHOD = "        self.quant_method = self._get_quant_method("
CREATE = "self.quant_method.create_weights(layer=self, **moe_quant_params)"
CLASS_CREATE = (
    "type(self.quant_method).create_weights(\n"
    "            self.quant_method, layer=self, **moe_quant_params\n        )"
)
DRIFTS = (
    Drift("release", _next_release()),
    Drift(
        "nightly-renamed",
        _nightly(),
        {p: _renamed("_get_quant_method", "_build_quant_method") for p in RENAMED_BY},
    ),
    Drift("signature-changed", _nightly(), {DEFAULT_LOADER: _one_more_argument}),
    Drift("module-moved", _nightly(), moves={INT_WNA16: MOVED_TO}),
    Drift("in-tree", None, in_tree=True),
    Drift(
        "nightly-commented",
        _nightly(),
        {ROUTED_EXPERTS: _replaced(GET_METHOD, f"        # nightly\n{GET_METHOD}")},
        first="fp8-block | triton | TP32",
    ),
    Drift(
        "nightly-class-call",
        _nightly(),
        {ROUTED_EXPERTS: _replaced(CREATE, CLASS_CREATE)},
        first="nvfp4 | cutlass | TP32",
    ),
)


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _importers(source: Path, module: str) -> list[str]:
    """The vLLM files that name ``module`` (dotted)."""
    found = []
    for file in (source / "vllm").rglob("*.py"):
        if module in file.read_text(errors="replace"):
            found.append(file.relative_to(source).as_posix())
    return found


def _version_text(version: str) -> str:
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:3])
    return (
        f"__version__ = version = {version!r}\n"
        f"__version_tuple__ = version_tuple = {numbers!r}\n"
    )


def drifted_copy(drift: Drift, root: Path) -> Path:
    """Lay out ``root`` as the installed vLLM changed by ``drift``; returns
    ``root`` (put it first on ``PYTHONPATH``)."""
    source = patched_vllm.installed_vllm_parent()
    if drift.in_tree:
        release = patched_vllm.vllm_version(source)
        return patched_vllm.patched_copy(patches.patch_for(release), root).root
    edits = dict(drift.edits)
    for old, new in drift.moves.items():
        rewrite = _renamed(re.escape(_module(old)), _module(new))
        for importer in _importers(source, _module(old)):
            edits[importer] = rewrite
    changed = [*edits, *drift.moves, *drift.moves.values()]
    if drift.version is not None:
        changed.append(VERSION_FILE)
    root.mkdir(parents=True, exist_ok=True)
    patched_vllm.mirror(source, root, changed)
    for old, new in drift.moves.items():
        text = (source / old).read_text()
        (root / old).unlink()
        (root / new).write_text(edits.pop(old, lambda t: t)(text))
    for path, edit in edits.items():
        target = root / path
        target.write_text(edit(target.read_text()))
    if drift.version is not None:
        (root / VERSION_FILE).write_text(_version_text(drift.version))
    return root
