"""vLLM's weight-transfer engines on a CPU: the transport stood in, the rest
theirs.

``CpuTransferEngine`` (a vLLM ``IPCWeightTransferEngine``)
    On a GPU the IPC engine's ``receive_weights`` rebuilds each bucket's
    tensors from CUDA IPC handles the trainer exported, then loads them with
    ``model.load_weights``. A CPU has no CUDA IPC: the stand-in receives the
    bucket itself (``CpuUpdateInfo.bucket``: (name, tensor) pairs, or an
    iterable that raises as a receive timing out does) and loads it the same
    way. Everything around it is vLLM's own: ``start_weight_update`` and
    ``finish_weight_update`` (0.34: ``start_reload``/``finish_reload``, in
    the mode ``VLLM_RELOAD_MODE`` selects; 0.33: the layerwise reload's
    ``initialize``/``finalize``), and the base class's ``update_weights``,
    which parses the update info and receives it.
``torch.accelerator.synchronize`` (``stand_ins``)
    After each bucket vLLM waits for the device's streams; a CPU has no
    device (torch raises "Found no NVIDIA driver"): nothing to wait for, a
    no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_kimi_k3_moe.patching import replaced_attributes


@dataclass
class CpuUpdateInfo:
    """One bucket of an update, as the stand-in receives it."""

    bucket: Any


def transfer_engine(model: nn.Module, vllm_config: Any) -> Any:
    """An IPC weight-transfer engine of ``model`` whose receive is stood in."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    class CpuTransferEngine(IPCWeightTransferEngine):
        update_info_cls = CpuUpdateInfo

        def receive_weights(self, update_info: Any) -> None:
            received = list(update_info.bucket)  # may fail, as a receive does
            self.model.load_weights(received)

    config = WeightTransferConfig(backend="ipc")
    return CpuTransferEngine(config, vllm_config, torch.device("cpu"), model)


@contextmanager
def stand_ins() -> Iterator[None]:
    with replaced_attributes(torch.accelerator, synchronize=lambda *a, **k: None):
        yield
