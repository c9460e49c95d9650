"""pytest marks the Kimi-K3 tests share (apart from ``builders``, which the
benchmarks import where pytest is not installed)."""

from __future__ import annotations

import pytest

from tests.models.kimi_k3.builders import MXFP4_FORMATS

# Native MXFP4 (the released checkpoint, rewritten by vLLM) and the
# compressed-tensors MXFP4 method (other compressed-tensors formats).
on_both_quantization_paths = pytest.mark.parametrize("quantization", MXFP4_FORMATS)
