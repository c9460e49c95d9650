"""The checkpoint ``check`` reads for a model named by path or Hugging Face id.

``vllm serve moonshotai/Kimi-K3`` loads the copy ``hf download`` put in the
Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
``~/.cache/huggingface/hub``): ``check`` reads the same files there,
found by ``huggingface_hub``'s own cache lookup (the snapshot the ``main``
ref points to), so a serve line ``plan`` printed with its default model
checks as it is. Where no copy is cached, the error says the two commands
that work. ``huggingface_hub`` (a vLLM dependency, no torch) is imported
only for a name that is not a directory.
"""

from __future__ import annotations

from pathlib import Path

from vllm_kimi_k3_moe.tools.check.layout import PreflightInputError
from vllm_kimi_k3_moe.tools.check.preflight import refuse_a_missing_directory

# The file whose cached copy locates the snapshot: every checkpoint has one.
CONFIG_JSON = "config.json"


def _is_hub_id(name: str) -> bool:
    """Whether ``name`` is a Hugging Face repository id, as the Hub
    validates one (``owner/name``)."""
    if Path(name).is_absolute() or name.count("/") != 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str) -> Path | None:
    """The directory of ``repo_id``'s cached snapshot (its ``main`` ref) that
    holds its ``config.json``, or None where the cache has none."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, CONFIG_JSON)
    return Path(found).parent if isinstance(found, str) else None


def checkpoint_directory(model: str) -> Path:
    """The directory ``check`` reads for ``model``: itself where it exists,
    else, for a Hugging Face id, its snapshot in the Hugging Face cache;
    ``PreflightInputError`` (one line, the commands that work) otherwise."""
    path = Path(model)
    if path.exists() or not _is_hub_id(model):
        refuse_a_missing_directory(path)
        return path
    snapshot = cached_snapshot(model)
    if snapshot is not None:
        return snapshot
    from huggingface_hub import constants

    raise PreflightInputError(
        f"{model} is neither a directory nor in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); download it there with `hf download "
        f"{model}` (where vllm serve then loads it from), or name your copy: "
        "`vllm-kimi-k3-moe check DIR --serve-command ...`"
    )
