"""Stand-ins for what a CPU box lacks when vLLM builds the whole Kimi-K3 model.

Building vLLM 0.33.0's ``KimiLinearForCausalLM`` on the ``meta`` device (real
shapes, no memory) touches the GPU in a few places that allocate no
parameter: CUDA streams and events (created for overlapping work), the MLA
attention kernel objects (chosen for, and sized to, the GPU the model runs
on), and the GPU's compute-unit count. Each stand-in below replaces one of
those for the duration of a ``with`` block and holds no parameters, so every
parameter the model allocates is vLLM's own; everything it replaces is
restored on exit. The parallel groups are ``simulated_rank``'s.

``current_platform.num_compute_units()`` (which a CPU platform does not
implement) needs no stand-in: only the MLA kernel objects ask for it, and
they are stood in for here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vllm_kimi_k3_moe.simulated_rank import replaced_attributes


class CudaStreamStandIn:
    """Replaces ``torch.cuda.Stream`` and ``torch.cuda.Event`` at construction:
    a CPU box has no CUDA runtime to create them. It holds no parameters and
    is never used (the model is built, not run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextmanager
def cuda_streams_and_events() -> Iterator[None]:
    """``torch.cuda.Stream()`` and ``torch.cuda.Event()`` build a stand-in
    (the model creates them in ``KimiLinearModel``, ``KimiMoE``, the KDA and
    MLA layers and the latent MoE runner). Holds no parameters."""
    import torch

    with replaced_attributes(
        torch.cuda, Stream=CudaStreamStandIn, Event=CudaStreamStandIn
    ):
        yield


class MlaKernelStandIn:
    """Replaces an MLA attention backend's kernel implementation (its
    ``impl``) and the MLA prefill backend: they hold kernels chosen for the
    GPU (FlashMLA, FlashInfer, CUTLASS MLA, FlashAttention prefill), not
    parameters, and a CPU box can neither select nor import them. It holds
    no parameters."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class MlaBackendStandIn:
    """The attention backend ``get_attn_backend`` returns for Kimi-K3's MLA
    layers on a CPU: its ``impl`` is a ``MlaKernelStandIn``. Holds no
    parameters."""

    @staticmethod
    def get_name() -> str:
        return "MLA_STAND_IN"

    @staticmethod
    def get_impl_cls() -> type:
        return MlaKernelStandIn


@contextmanager
def mla_attention_kernels() -> Iterator[None]:
    """Kimi-K3's ``MultiHeadLatentAttention`` gets ``MlaBackendStandIn`` from
    ``get_attn_backend`` and ``MlaKernelStandIn`` as its prefill backend,
    looked up in vLLM's Kimi-K3 ``mla`` module only: the layer's projections
    and norms (its parameters) are vLLM's own. Holds no parameters."""
    from vllm.models.kimi_k3.nvidia import mla

    with replaced_attributes(
        mla,
        get_attn_backend=lambda *args, **kwargs: MlaBackendStandIn,
        get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
    ):
        yield


@contextmanager
def whole_model_on_cpu() -> Iterator[None]:
    """Every stand-in above, entered together."""
    with ExitStack() as stack:
        stack.enter_context(cuda_streams_and_events())
        stack.enter_context(mla_attention_kernels())
        yield
