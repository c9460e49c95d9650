"""Stand-ins for the GPU a CPU test box lacks, used by the tests only: the
Marlin device check alone, and the attention layer of a decoder layer built
without its attention. The stand-ins the planner shares
(every MoE kernel's device check, CUDA streams and events, MLA kernels) are
in ``vllm_kimi_k3_moe.tools.build.stand_ins``. Everything else stays vLLM's own
code. Each stand-in is undone when its context or the test ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from vllm_kimi_k3_moe.patching import replaced_attributes


@contextmanager
def marlin_without_gpu() -> Iterator[None]:
    """Let vLLM select the Marlin MoE kernel on a machine without CUDA, as
    ``--moe-backend marlin`` does on the GPUs it runs on. Its device check
    (``_supports_current_device``: CUDA, capability 7.5 or above) is the only
    part of the selection that needs a GPU, and a CPU box has none."""
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe

    with mock.patch.object(
        marlin_moe.MarlinExpertsBase,
        "_supports_current_device",
        staticmethod(lambda: True),
    ):
        yield


class AttentionStandIn(nn.Module):
    """Replaces ``MultiHeadLatentAttention`` in decoder-layer tests: vLLM picks
    an attention backend for the current platform at construction, and the
    unspecified CPU platform has none. The MoE half of the layer is real."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


def _situ_and_mul_on_cpu(
    out: Tensor, input: Tensor, beta: float, linear_beta: float
) -> None:
    """``_C::situ_and_mul`` as vLLM's own ``SituAndMul.forward_native``
    computes it (``linear_beta <= 0`` means unset, as for the CUDA kernel)."""
    from vllm.model_executor.layers.activation import SituAndMul

    # Not SituAndMul(beta, linear_beta): a CustomOp's __init__ wants a current
    # VllmConfig to pick its dispatch; forward_native reads only the betas.
    activation = SituAndMul.__new__(SituAndMul)
    activation.beta = float(beta)
    activation.linear_beta = None if linear_beta <= 0 else float(linear_beta)
    out.copy_(SituAndMul.forward_native(activation, input))


@contextmanager
def situ_and_mul_op_on_cpu() -> Iterator[None]:
    """vLLM's MoE activation (``apply_moe_activation``) calls
    ``torch.ops._C.situ_and_mul``, a CUDA kernel from ``vllm._C``, which a
    CUDA wheel on a CPU box does not load (``No module named 'vllm._C'``).
    The op is defined for the block with a CPU kernel that is vLLM's own
    pure-torch SiTU; the definition is removed again on exit."""
    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define(
            "situ_and_mul(Tensor! out, Tensor input, float beta, "
            "float linear_beta) -> ()"
        )
        library.impl("situ_and_mul", _situ_and_mul_on_cpu, "CPU")
        yield
    finally:
        library._destroy()


def _not_capturing() -> bool:
    return torch.compiler.is_compiling()


@contextmanager
def moe_forward_on_cpu() -> Iterator[None]:
    """What vLLM's batched reference MoE kernel needs from a GPU worker: the
    SiTU op (``situ_and_mul_op_on_cpu``); ``fused_batched_moe.
    _is_capturing_or_compiling``, which asks the CUDA driver whether a CUDA
    graph is being captured (``torch.accelerator.current_stream()`` raises
    without one): nothing is captured on a CPU, so only the compile half of
    the question is asked; and the workspace manager a GPU worker creates at
    start-up (``init_workspace_manager``), where the kernel takes its scratch
    buffers: vLLM's own ``WorkspaceManager``, on the CPU, a fresh one per
    block so no buffer outlives a forward. None holds state that changes a
    result; everything is put back on exit."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
    from vllm.v1.worker import workspace

    with ExitStack() as stack:
        stack.enter_context(situ_and_mul_op_on_cpu())
        stack.enter_context(
            replaced_attributes(
                fused_batched_moe, _is_capturing_or_compiling=_not_capturing
            )
        )
        stack.enter_context(
            replaced_attributes(
                workspace, _manager=workspace.WorkspaceManager(torch.device("cpu"))
            )
        )
        yield


class _FilledEmpty(TorchFunctionMode):
    """Fills every contiguous CPU tensor ``torch.empty`` returns with one byte.
    A mode, not a replaced ``torch.empty``: torch's device contexts recognise
    the constructors they place by identity, and a replacement seen by the
    first ``torch.device`` block of a process stays in torch's cache (a later
    ``torch.device("meta")`` then no longer places ``torch.empty``)."""

    def __init__(self, byte: int) -> None:
        super().__init__()
        self.byte = byte

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if (
            func is torch.empty
            and isinstance(result, Tensor)
            and result.device.type == "cpu"
            and result.dim()
            and result.is_contiguous()
        ):
            result.view(torch.uint8).fill_(self.byte)
        return result


@contextmanager
def uninitialised_memory_reads(byte: int) -> Iterator[None]:
    """``torch.empty`` on the CPU returns tensors whose bytes are ``byte``:
    what a GPU allocation may hold before anything is written (a CPU often
    hands out zeroed pages instead, which would hide a pad nobody wrote)."""
    with _FilledEmpty(byte):
        yield
