"""A vLLM cache directory of its own for a child process that runs a copy of
vLLM (drifted, or patched in tree), holding what the installed vLLM cached of
its model classes.

vLLM caches what it inspects of a model class (``_ModelInfo``) in one file
per class under ``VLLM_CACHE_ROOT/modelinfos``, keyed by a hash of the class's
package; on a miss it inspects the class in a child process of its own
(about 20 s on CI's 2 cores) and writes the file over. A copy whose Kimi-K3
package is the installed one's finds its entry here. The in-tree patch's
copies, whose package differs, cache where ``upstream.verify_patch`` keeps
theirs (``PATCHED_CACHE_ROOT``), never over the installed entry, which every
later process of the suite would otherwise inspect again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

KIMI_K3 = "KimiK3ForConditionalGeneration"  # what vllm serve builds


def installed_model_infos() -> Path:
    """Where the installed vLLM, as this process sees it, caches them
    (its registry's own directory), its Kimi-K3 entry current: vLLM's own
    lookup, which inspects the class where the entry is missing or another
    package's (once a suite: the first of its processes to miss would
    otherwise be each copy's)."""
    from vllm.model_executor.models.registry import ModelRegistry

    registered = ModelRegistry.models[KIMI_K3]
    registered.inspect_model_cls()
    return registered._get_cache_dir()


def seeded_cache_root(directory: Path) -> Path:
    """``directory`` as a vLLM cache root holding a copy of the installed
    model-info cache."""
    source = installed_model_infos()
    shutil.copytree(source, directory / source.name)
    return directory
