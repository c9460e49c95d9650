"""A patched copy of the installed vLLM, made without writing into it.

``patched_copy(patch, root)`` lays out ``root/vllm`` as the installed ``vllm``
package: real directories along the paths the patch touches, real copies of
the files it changes (their cached bytecode left behind), and symbolic links
for everything else, compiled extensions included (877 MB are not copied).
``git apply`` then writes the patch into that tree, new files such as
``root/tests/...`` included. With ``root`` first on ``PYTHONPATH`` Python
imports the patched vLLM; its distribution metadata stays the installed
one's.

Before anything is written, ``git apply --check`` runs against the copy: a
patch that does not apply (another vLLM than the release it was made for,
``upstream.patches``) stops there with ``PatchDoesNotApply``, whose message
names the first file that differs in one line. Every file the patch writes
is checked to be a real file inside ``root``, never a link into the installed
package.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from upstream.patches import release_of

PACKAGE = "vllm"


class PatchDoesNotApply(Exception):
    """The patch does not apply to this vLLM; nothing was written."""


@dataclass(frozen=True)
class PatchedCopy:
    root: Path  # put first on PYTHONPATH: holds vllm/ and the patch's tests/
    source: Path  # the directory holding the vllm package that was copied
    version: str  # that vLLM's version, as its _version.py states it
    touched: tuple[str, ...]  # paths the patch writes, relative to root


def installed_vllm_parent() -> Path:
    """The directory holding the installed ``vllm`` package (found without
    importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("vLLM is not installed in this Python")
    return Path(spec.origin).resolve().parent.parent


def vllm_version(parent: Path) -> str:
    """The version ``parent/vllm/_version.py`` states, without importing it."""
    text = (parent / PACKAGE / "_version.py").read_text()
    match = re.search(r"__version__ = version = '([^']+)'", text)
    return match.group(1) if match else "unknown"


def patch_paths(patch: Path, cwd: Path) -> tuple[str, ...]:
    """The paths ``patch`` changes or creates, as ``git apply`` reads them
    (run in ``cwd``, a directory outside any git work tree)."""
    out = _git("apply", "--numstat", str(patch), cwd=cwd)
    return tuple(line.split("\t", 2)[2] for line in out.splitlines() if line)


def patched_copy(patch: Path, root: Path, source: Path | None = None) -> PatchedCopy:
    """Lay out ``root`` as a copy of the vLLM in ``source`` (by default the
    installed one) and apply ``patch`` to it. Raises ``PatchDoesNotApply``
    (nothing applied) when the patch does not fit that vLLM."""
    patch, root = patch.resolve(), root.resolve()
    source = (source or installed_vllm_parent()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    touched = patch_paths(patch, root)
    mirror(source, root, [p for p in touched if p.split("/")[0] == PACKAGE])
    _check_real_files(root, touched)
    version = vllm_version(source)
    check = _git_run("apply", "--check", str(patch), cwd=root)
    if check.returncode != 0:
        raise PatchDoesNotApply(_one_line(check.stderr, patch, source, version))
    _git("apply", str(patch), cwd=root)
    _check_real_files(root, touched)
    return PatchedCopy(root, source, version, touched)


def mirror(source: Path, root: Path, paths: list[str]) -> None:
    """Real directories along ``paths``, real copies of the files at them,
    links for every other entry of those directories."""
    real_dirs: set[Path] = set()
    copies: set[Path] = set()
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            real_dirs.add(Path(*parts[:depth]))
        copies.add(Path(path))
    for directory in sorted(real_dirs, key=lambda p: len(p.parts)):
        (root / directory).mkdir(exist_ok=True)
        for entry in (source / directory).iterdir():
            relative = directory / entry.name
            target = root / relative
            if relative in real_dirs or target.exists() or target.is_symlink():
                continue
            if relative in copies:
                shutil.copyfile(entry, target)  # a fresh mtime: no stale bytecode
            elif entry.name == "__pycache__":
                copied = {c.stem for c in copies if c.parent == directory}
                _link_bytecode(entry, target, copied)
            else:
                target.symlink_to(entry)


def _link_bytecode(source: Path, target: Path, copied_modules: set[str]) -> None:
    """A real ``__pycache__`` whose entries link to the installed bytecode,
    but for the modules the patch changes (Python writes nothing here: a new
    entry would replace a link, never write through it)."""
    target.mkdir()
    for entry in source.iterdir():
        if entry.name.split(".", 1)[0] not in copied_modules:
            (target / entry.name).symlink_to(entry)


def _check_real_files(root: Path, paths: tuple[str, ...]) -> None:
    """Every path the patch writes is (or will be) a real file in ``root``."""
    for path in paths:
        target = root / path
        for parent in [target, *target.parents]:
            if parent == root:
                break
            if parent.is_symlink():
                raise RuntimeError(
                    f"{parent} is a link: the patch would write through it"
                )
        if target.exists() and root not in target.resolve().parents:
            raise RuntimeError(f"{target} resolves outside {root}")


def _one_line(stderr: str, patch: Path, source: Path, version: str) -> str:
    """``git apply --check``'s complaint, as one line naming the first file."""
    files = list(
        dict.fromkeys(re.findall(r"^error: (?:patch failed: )?([^:\s]+)", stderr, re.M))
    )
    first = files[0] if files else "a file"
    more = f" (and {len(files) - 1} more)" if len(files) > 1 else ""
    made_for = release_of(patch)
    made = f"vLLM {made_for}'s" if made_for else "the vLLM it was made for"
    return (
        f"{patch.name} does not apply to vLLM {version} at {source}: {first}{more} "
        f"differs from {made}; nothing was changed"
    )


def _git_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # No repository above ``cwd`` may take over the paths (git apply inside
    # a work tree resolves them from its top level).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


def _git(*args: str, cwd: Path) -> str:
    result = _git_run(*args, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout
