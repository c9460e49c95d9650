"""vLLM's output kept off the terminal while the tools import it and build
its model on a machine without a GPU: the commands' stdout is their answer,
their stderr their own lines."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

# --verbose: what vLLM, torch and their kernel libraries print is shown as
# it is printed (``show_what_vllm_prints``), not kept off the terminal
_shown = False


def show_what_vllm_prints(shown: bool = True) -> None:
    """``--verbose``: ``quiet_vllm`` lets vLLM's and torch's lines through."""
    global _shown
    _shown = shown


@contextmanager
def quiet_vllm() -> Iterator[None]:
    """Importing vLLM and building its model on a machine without a GPU
    prints lines that are harmless here (``Failed to import from vllm._C``,
    ``No CUDA runtime is found``, deprecation warnings of torch and its
    kernel libraries): they go to a temporary file, shown only if the block
    fails with an error the command does not explain itself (``--verbose``:
    shown as printed, ``show_what_vllm_prints``). vLLM logs
    warnings and errors (``VLLM_LOGGING_LEVEL``, unless set) to stderr,
    never to stdout, which is the command's output."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if _shown:  # --verbose: on stderr as printed
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        except (SystemExit, ValueError):
            failed = False  # the command's own one-line errors
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                captured.seek(0)
                sys.stderr.write(captured.read().decode(errors="replace"))
