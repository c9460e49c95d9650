"""No two installed distributions own the same importable file.

When two wheels ship one path, the one installed last silently wins (uv links
wheels in parallel, so which one varies between installs). This is how an old
``cuda-python`` (12.x, with its own ``cuda/bindings/*.so``) beside
``cuda-bindings`` 13.x broke vLLM's CUTLASS DSL import in one fresh venv and
not in another. The test reads every distribution's RECORD through
``importlib.metadata``, so it checks whichever environment runs the suite.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections import defaultdict
from pathlib import Path

# Files two distributions may both own, with why that is harmless. Namespace
# packages need no entry: PEP 420 ones ship no ``__init__.py`` at all.
SHARED_ON_PURPOSE = {
    # flashinfer-python and torch_c_dlpack_ext (both pulled in by vLLM 0.33.0)
    # each ship the PEP 517 in-tree build backend they were built with as a
    # top-level module. Nothing imports it at run time; either copy will do.
    "build_backend.py": {"flashinfer-python", "torch_c_dlpack_ext"},
}


def owners_of_importable_files() -> dict[str, set[str]]:
    """Importable file (relative to the ``sys.path`` entry it is installed
    in) -> names of the installed distributions whose RECORD lists it."""
    import_roots = {os.path.realpath(p) for p in sys.path if p}
    owners: dict[str, set[str]] = defaultdict(set)
    for dist in importlib.metadata.distributions():
        root = os.path.realpath(dist.locate_file(""))
        if root not in import_roots:
            continue
        dist_name = dist.metadata["Name"]
        for file in dist.files or ():
            # RECORD paths are relative to that root; scripts leave it by "..".
            name = os.path.normpath(str(file))
            if not name.startswith("..") and ".dist-info" not in name:
                owners[Path(name).as_posix()].add(dist_name)
    return owners


def source_of(name: str) -> str:
    """The module a file belongs to: ``pkg/__pycache__/mod.cpython-311.pyc``
    (which pip lists in RECORD) is ``pkg/mod.py``."""
    path = Path(name)
    if path.parent.name == "__pycache__" and path.suffix == ".pyc":
        return (path.parent.parent / f"{path.name.split('.')[0]}.py").as_posix()
    return name


def test_no_file_is_installed_by_two_distributions():
    overlaps = {
        name: sorted(dists)
        for name, dists in owners_of_importable_files().items()
        if len(dists) > 1 and SHARED_ON_PURPOSE.get(source_of(name)) != dists
    }
    assert not overlaps, "two distributions install the same file:\n" + "\n".join(
        f"  {name}: {' and '.join(dists)}" for name, dists in sorted(overlaps.items())
    )


def test_the_check_sees_this_environment():
    """The check reads real RECORDs: it finds vLLM's and torch's files where
    they are imported from."""
    owners = owners_of_importable_files()
    assert owners["vllm/__init__.py"] == {"vllm"}
    assert owners["torch/__init__.py"] == {"torch"}
