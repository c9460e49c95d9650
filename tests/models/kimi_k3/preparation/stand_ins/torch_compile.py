"""Functions vLLM compiles with ``torch.compile``, run as the Python they are.

``torch.compile`` (``deep_gemm.per_block_cast_to_fp8``, the online FP8 per
block method's quantizer, and any other compiled helper a preparation calls)
    On a GPU, the first call of each compiled function traces it and builds a
    kernel that computes what the function's Python computes (torch's
    contract for ``torch.compile``); on these two shared cores the trace alone
    takes 30 s or more per function and shape. Under the stand-in
    (``torch.compiler.set_stance("force_eager")``) every compiled function
    runs its own Python, eagerly: the same values, none of the compile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stand_ins() -> Iterator[None]:
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield
