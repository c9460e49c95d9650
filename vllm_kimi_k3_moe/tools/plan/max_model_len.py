"""``--max-model-len`` as vLLM reads it, for ``plan``'s serving options."""

from __future__ import annotations

import argparse
import re

from vllm_kimi_k3_moe.tools.deployment.topology import DeploymentError
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm


def max_model_len(text: str) -> int:
    """vLLM's ``--max-model-len``, read by vLLM's own parser function
    (``human_readable_int_or_auto``: 131072, 128k = 128000, 128K = 131072,
    1.5m); ``DeploymentError`` in one line where it refuses. Imports vLLM's
    argument utilities, and with them torch (seconds): call it after every
    check that needs no vLLM. vLLM's ``auto`` (-1) is refused too: vLLM
    picks that length from the GPU it starts on. What no reading of vLLM's
    takes is refused first, without importing it (``_refuse_non_lengths``)."""
    _refuse_non_lengths(text)
    with quiet_vllm():
        from vllm.utils.argparse_utils import human_readable_int_or_auto
    where = f"--max-model-len {text!r}"
    try:
        value = human_readable_int_or_auto(text)
    except argparse.ArgumentTypeError as error:  # its own words
        raise DeploymentError(f"{where}: {error}") from None
    except ValueError:
        raise DeploymentError(f"{where} {NOT_A_LENGTH}") from None
    if value == -1:
        raise DeploymentError(
            f"{where}: vLLM picks that length on the GPU at start-up; give one "
            "(plan reports the longest that fits when a request of it does not)"
        )
    if value < 1:
        raise DeploymentError(f"{where} is not a positive length")
    return value


NOT_A_LENGTH = "is not a length vLLM takes (e.g. 131072, 128k = 128000, 128K = 131072)"
# Wider than what vLLM's human_readable_int_or_auto reads (a number, with a
# k/m/g/t suffix or not; int()'s signs and underscores; "auto"), so that
# only what vLLM refuses too is refused without it (a test holds the two
# together); vLLM's function still reads the value.
_MAYBE_A_LENGTH = re.compile(r"[+-]?[\d_.]+[kKmMgGtT]?|auto", re.IGNORECASE)


def _refuse_non_lengths(text: str) -> None:
    """A ``--max-model-len`` no reading of vLLM's takes (a typo: letters,
    punctuation), refused in one line before vLLM and torch are imported."""
    if _MAYBE_A_LENGTH.fullmatch(text.strip()) is None:
        raise DeploymentError(f"--max-model-len {text!r} {NOT_A_LENGTH}")
