"""Stands in for the attention kernels of the GPU: MLA's (dense, and the
sparse MLA of a config with ``dsa_config``) and the KDA layer's prefill
kernel choice.

Why: these kernels are chosen for, sized to and imported on the GPU the
model runs on (FlashMLA, FlashInfer, CUTLASS MLA, FlashAttention prefill,
FlashKDA); a CPU box can neither select nor import them.
What the real ones guarantee that the tools rely on, and keep: what each
backend says about the KV cache (kernel block sizes, the cache layout, its
spec customisation, the ``fp8_ds_mla`` row bytes), which is vLLM's own code
here, so the KV-cache specs are what a server computes; the KDA prefill
kernel a GPU resolves, which sets the state blocks a sequence holds. The
layers' projections, norms and indexers (their parameters) are vLLM's own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


class MlaKernelStandIn:
    """Replaces an MLA attention backend's kernel implementation (its
    ``impl``) and the MLA prefill backend: they hold kernels chosen for the
    GPU (FlashMLA, FlashInfer, CUTLASS MLA, FlashAttention prefill), not
    parameters, and a CPU box can neither select nor import them. It holds
    no parameters. Under decode context parallelism the layer hands vLLM's
    DCP manager the base of the softmax LSE the kernel returns (FlashMLA's:
    natural log)."""

    lse_base_on_e = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@functools.cache
def mla_backend_stand_in() -> type:
    """vLLM's FlashMLA attention backend with ``MlaKernelStandIn`` as its
    ``impl``: what the backend says about the KV cache (kernel block sizes,
    the cache layout, how it customises the MLA spec) is vLLM's own, so the
    KV-cache specs are what a server computes; its kernels are not built.
    FlashMLA runs Kimi-K3's MLA on Hopper and Blackwell; FlashInfer MLA
    (Blackwell's first choice) gives the same block size, as every NVIDIA
    MLA backend's alignment is rounded up to 128 for a hybrid model. The
    FlashAttention MLA backend (Hopper's first choice) does not import on a
    CPU. Holds no parameters."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    class MlaBackendStandIn(FlashMLABackend):
        @staticmethod
        def get_impl_cls() -> type:
            return MlaKernelStandIn

    return MlaBackendStandIn


@contextmanager
def mla_attention_kernels() -> Iterator[None]:
    """Kimi-K3's ``MultiHeadLatentAttention`` gets ``mla_backend_stand_in()``
    from ``get_attn_backend`` and ``MlaKernelStandIn`` as its prefill
    backend, looked up in vLLM's Kimi-K3 ``mla`` module only: the layer's
    projections and norms (its parameters) are vLLM's own. Holds no
    parameters."""
    from vllm.models.kimi_k3.nvidia import mla

    backend = mla_backend_stand_in()
    with replaced_attributes(
        mla,
        get_attn_backend=lambda *args, **kwargs: backend,
        get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
    ):
        yield


@functools.cache
def sparse_mla_backend_stand_in() -> type:
    """vLLM's FlashMLA sparse attention backend with a kernel stand-in as its
    ``impl``, for the sparse (DSA) MLA layers a config with ``dsa_config``
    builds: what the backend says about the KV cache (kernel block sizes,
    its spec customisation, the ``fp8_ds_mla`` format it serves an FP8 KV
    cache in) is vLLM's own; its kernels are not built. FlashMLA sparse runs
    on Hopper and Blackwell and is Hopper's only sparse backend for an FP8
    KV cache; the FlashAttention sparse backend (Hopper's first choice for
    bfloat16) does not import on a CPU. The stand-in kernel says it is
    sparse, has no dense-MHA prefill (so no prefill backend is chosen) and
    gives the ``fp8_ds_mla`` row bytes FlashMLA sparse's implementation
    gives. Holds no parameters."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        FlashMLASparseBackend,
        FlashMLASparseImpl,
    )

    class SparseMlaKernelStandIn(FlashMLASparseImpl):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # vLLM's __new__ reads the rank's DCP and PCP groups

    class SparseMlaBackendStandIn(FlashMLASparseBackend):
        @staticmethod
        def get_impl_cls() -> type:
            return SparseMlaKernelStandIn

    return SparseMlaBackendStandIn


@contextmanager
def sparse_mla_attention_kernels() -> Iterator[None]:
    """vLLM's generic ``MLAAttention`` (which the DSA layers of a config with
    ``dsa_config`` build, through ``MultiHeadLatentAttentionWrapper``) gets
    ``sparse_mla_backend_stand_in()`` where it asks for a sparse backend,
    looked up in vLLM's ``mla_attention`` module only; a dense request gets
    vLLM's own answer. A CPU box's platform has no sparse MLA backend
    ("Invalid attention backend"). The layer's projections, norms and DSA
    indexer (its parameters) are vLLM's own. Holds no parameters."""
    from vllm.model_executor.layers.attention import mla_attention

    own = mla_attention.get_attn_backend
    backend = sparse_mla_backend_stand_in()

    def sparse_on_the_gpu(*args: Any, **kwargs: Any) -> type:
        return backend if kwargs.get("use_sparse") else own(*args, **kwargs)

    with replaced_attributes(
        mla_attention,
        get_attn_backend=sparse_on_the_gpu,
        get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
    ):
        yield


# What vLLM's KDA layer resolves its prefill kernel to on the GPUs Kimi-K3
# runs on: ``resolve_kda_prefill_backend("auto", ...)`` picks FlashKDA on CUDA
# compute capability 9.x, 10.x and 12.x (H20, H200, B200, ...).
GPU_KDA_PREFILL_BACKEND = "flashkda"


def kda_prefill_kernel_of_the_gpu(vllm_config: Any) -> None:
    """Set each built KDA layer's ``kda_prefill_backend`` to what a GPU
    resolves (``GPU_KDA_PREFILL_BACKEND``): a CPU box resolves Triton, and
    the kernel decides how many state blocks a sequence holds in the KV
    cache (FlashKDA keeps a prefill checkpoint block). Building the layer
    with FlashKDA is not possible here: it imports the kernel's CUDA
    library. Holds no parameters; changes no parameter."""
    for layer in vllm_config.compilation_config.static_forward_context.values():
        if hasattr(layer, "kda_prefill_backend"):
            layer.kda_prefill_backend = GPU_KDA_PREFILL_BACKEND
