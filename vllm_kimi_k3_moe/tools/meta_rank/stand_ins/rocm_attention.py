"""Stands in for what a CPU box lacks when vLLM selects Kimi-K3's MLA
attention backend on an AMD GPU: ROCm as the platform vLLM's attention
selector asks, and the selected backend's kernel object.

Why: vLLM picks the MLA backend by asking the current platform
(``selector.get_attn_backend`` -> ``current_platform.get_attn_backend_cls``);
ROCm's answer (``RocmPlatform.get_attn_backend_cls``) depends on the GPU
architecture and AITER's switches, which ``rocm_platform.an_amd_gpu`` stands
in for, and on the deployment (DCP, ``--attention-backend``, the KV-cache
dtype, ``--block-size``), which the ``VllmConfig`` holds. A CPU box's
platform is the CPU one, whose selector offers CPU backends only. While
entered, ``vllm.platforms``' current platform, as the selector looks it up
at each call, is vLLM's own ``RocmPlatform``: the backend is what ROCm's
selector returns, its priorities and each backend's
``validate_configuration`` (head size, dtype, block size, DCP) run as
vLLM's code. The selector's answers are cached by vLLM with no platform in
the key, so the cache is emptied on entry and on exit.

The backend's kernel object (its ``impl``) is vLLM's own implementation
class with its ``__init__`` not run: AITER MLA's imports AITER's kernels and
asks the GPU its compute units, which a CPU box has neither of. What the real
one guarantees and the tools read is kept, being class attributes and the
backend's own classmethods: DCP support, the LSE base the DCP merge reads,
the kernel block sizes, the KV-cache shape and layout. The layers'
parameters are vLLM's own. Holds no parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.gpus import XPU, named_amd_arch
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.amd_gpu import (
    as_on_the_named_amd_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.attention_kernels import (
    MlaKernelStandIn,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_platform import rocm_module


@contextmanager
def rocm_selects_attention() -> Iterator[None]:
    """While entered (inside ``rocm_platform.an_amd_gpu``), vLLM's
    attention selector asks vLLM's ``RocmPlatform``: the current platform as
    ``vllm.platforms`` gives it to code that looks it up when it runs (the
    selector does); modules that imported it earlier keep theirs. The
    selector's cache is emptied on entry and exit."""
    import vllm.platforms as platforms
    from vllm.v1.attention import selector

    rocm = rocm_module().RocmPlatform()
    selector._cached_get_attn_backend.cache_clear()
    try:
        with replaced_attributes(platforms, _current_platform=rocm):
            yield
    finally:
        selector._cached_get_attn_backend.cache_clear()


@functools.cache
def without_kernels(backend: type, asked: tuple[Any, ...] = ()) -> type:
    """``backend`` (vLLM's class, as ROCm's selector returned it) whose
    implementation is vLLM's own class with its ``__init__`` not run (the
    module docstring); ``asked``: the selector's arguments, as the layer
    gave them (``(args, sorted keyword items)``), kept as ``ASKED`` so that
    the same question can be asked again under another config."""
    impl = backend.get_impl_cls()

    class KernelsNotBuilt(impl):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # imports AITER's kernels, asks the GPU its compute units

    class SelectedOnRocm(backend):  # type: ignore[misc, valid-type]
        ASKED = asked

        @staticmethod
        def get_impl_cls() -> type:
            return KernelsNotBuilt

    SelectedOnRocm.__name__ = SelectedOnRocm.__qualname__ = backend.__name__
    return SelectedOnRocm


def rocm_selected_backend(*args: Any, **kwargs: Any) -> type:
    """vLLM's ``get_attn_backend`` as it answers on ROCm (inside
    ``an_amd_gpu``, under the ``VllmConfig`` being built), its kernels not
    built; raises as vLLM's selector does where no ROCm backend takes the
    layer (``ValueError``)."""
    from vllm.v1.attention.selector import get_attn_backend

    with rocm_selects_attention():
        selected = get_attn_backend(*args, **kwargs)
    return without_kernels(selected, (args, tuple(sorted(kwargs.items()))))


@contextmanager
def rocm_mla_attention_kernels() -> Iterator[None]:
    """The MLA layers of vLLM's AMD Kimi-K3 (vLLM's generic ``MLAAttention``,
    in ``model_executor.layers.attention.mla_attention``) and of the DSpark
    draft vLLM serves with it (``kimi_k3.nvidia.mla``'s, on every platform)
    get the backend
    vLLM's ROCm selector picks (``rocm_selected_backend``) where they ask for
    a dense one (a sparse request keeps what ``sparse_mla_attention_kernels``
    gives), and ``MlaKernelStandIn`` as their prefill backend (AITER's or
    FlashAttention's kernels; it sizes no KV cache). Enter inside
    ``an_amd_gpu`` and after ``whole_model_on_cpu``, which it overrides.
    Holds no parameters."""
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.kimi_k3.nvidia import mla

    sparse = mla_attention.get_attn_backend

    def on_rocm(*args: Any, **kwargs: Any) -> type:
        if kwargs.get("use_sparse"):
            return sparse(*args, **kwargs)
        return rocm_selected_backend(*args, **kwargs)

    with (
        replaced_attributes(
            mla_attention,
            get_attn_backend=on_rocm,
            get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
        ),
        replaced_attributes(
            mla,
            get_attn_backend=rocm_selected_backend,
            get_mla_prefill_backend=lambda vllm_config: MlaKernelStandIn,
        ),
    ):
        yield


def mla_backend_on_the_named_amd_gpu(vllm_config: Any, backend: type) -> str | None:
    """The name of the backend vLLM's ROCm selector picks under
    ``vllm_config`` for the layer that was built with ``backend`` (a
    ``rocm_selected_backend``), asked as that layer asked, on the AMD GPU
    ``an_amd_gpu_named`` holds; None where no AMD GPU (or an Intel one) is
    named. Raises vLLM's ``ValueError`` where no ROCm backend takes the
    layer."""
    from vllm.config import set_current_vllm_config

    if named_amd_arch() in (None, XPU):
        return None
    args, keywords = backend.ASKED
    with as_on_the_named_amd_gpu(), set_current_vllm_config(vllm_config):
        return rocm_selected_backend(*args, **dict(keywords)).get_name()
