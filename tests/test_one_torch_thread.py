"""The suite's processes compute on one torch thread each (``tests/conftest.py``
says why), whatever the machine's core count."""

from __future__ import annotations

import os

import pytest


def test_torch_runs_one_thread_per_process() -> None:
    """The setting reached torch: set after torch started, it would keep one
    thread per core. Child processes inherit the variable."""
    import torch

    if os.environ["OMP_NUM_THREADS"] != "1":
        pytest.skip(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} given")
    assert torch.get_num_threads() == 1
