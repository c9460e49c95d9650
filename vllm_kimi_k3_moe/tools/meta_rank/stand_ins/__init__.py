"""Stand-ins for what a CPU box lacks when vLLM builds Kimi-K3's layers, one
module for each thing stood in for (each says why, and what the real one
guarantees).

Building vLLM's Kimi-K3 on the ``meta`` device (real shapes, no memory)
touches the GPU in places that allocate no parameter. Each stand-in replaces
one of those for the duration of a ``with`` block and holds no parameters,
so every parameter the model allocates is vLLM's own; everything it replaces
is restored on exit (``patching.replaced_attributes``). The parallel groups
are ``rank.simulated_rank``'s. The planner, ``selftest`` and the test suite
share these (the suite keeps only stand-ins for parts it replaces whole).
The ledger of all of them, with what to re-check at a vLLM bump, is
``vllm_kimi_k3_moe.tools.meta_rank``'s docstring.

- ``cuda_streams``: CUDA streams and events.
- ``attention_kernels``: MLA's and sparse MLA's kernels, KDA's prefill kernel.
- ``linear_kernels``: the GPU the FP8-block and NVFP4 linear kernels ask for.
- ``moe_kernels``: the GPU the MoE kernel selection asks for.
- ``cuda_platform``: the CUDA platform's answers while configs are made.
- ``model_loader``: the loader of a speculative-decoding draft (no weights).
- ``moe_forward``: the compiled ops of vLLM's batched reference MoE kernel.
- ``online_quantizers``: the GPU quantizers of vLLM's online MoE methods.
- ``collectives``: the all-reduce of online quantization's weight maxima.
- ``triton_on_cpu``: what vLLM's Triton MoE path calls besides Triton.
- ``data_parallel_group``: the DP group, for ``selftest`` on one GPU.
- ``vllm_package``: vLLM's package initialiser, for ``doctor``.
- ``rocm_platform``: an AMD GPU (ROCm, its architecture, AITER's switches).
- ``amd_gpu``: the AMD GPU ``plan --gpu``/``check --gpu`` names, as
  ``rocm_platform`` stands in for it.
- ``rocm_attention``: ROCm's attention selector and its MLA backend.
- ``rocm_model``: vLLM's AMD Kimi-K3 as the ``kimi_k3`` package exports it
  on ROCm, the current device, AITER's KDA kernel handle.

``current_platform.num_compute_units()`` (which a CPU platform does not
implement) needs no stand-in: only the MLA kernel objects ask for it, and
they are stood in for. The names below are importable from this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.attention_kernels import (
    GPU_KDA_PREFILL_BACKEND,
    MlaKernelStandIn,
    kda_prefill_kernel_of_the_gpu,
    mla_attention_kernels,
    mla_backend_stand_in,
    sparse_mla_attention_kernels,
    sparse_mla_backend_stand_in,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.collectives import (
    all_reduce_over_one_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.cuda_platform import (
    SERVING_GPU_CAPABILITY,
    a_cuda_device,
    a_cuda_platform_for_the_parser,
    a_gpu_of_capability,
    cuda_extensible_kv_cache,
    cuda_graph_capture_sizes,
    cuda_hybrid_kv_cache,
    the_serving_gpus_capability,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.cuda_streams import (
    CudaStreamStandIn,
    cuda_streams_and_events,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.data_parallel_group import (
    one_gpu_for_the_data_parallel_group,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.linear_kernels import (
    LinearKernelRegistryPlatform,
    linear_kernels_on_their_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.model_loader import (
    weightless_model_loader,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.moe_forward import (
    moe_forward_on_cpu,
    situ_and_mul_op_on_cpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.moe_kernels import (
    HOPPER,
    CudaPlatformStandIn,
    compressed_tensors_mxfp4_kernel,
    moe_kernel_of_the_gpu,
    moe_kernels_on_their_gpu,
    runs_on_capability,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.online_quantizers import (
    online_method_quantizers,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.triton_on_cpu import (
    TRITON_CONFIG_GPU,
    triton_moe_forward_on_cpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.vllm_package import (
    vllm_without_its_package_initialiser,
)

__all__ = [
    "GPU_KDA_PREFILL_BACKEND",
    "HOPPER",
    "SERVING_GPU_CAPABILITY",
    "TRITON_CONFIG_GPU",
    "CudaPlatformStandIn",
    "CudaStreamStandIn",
    "LinearKernelRegistryPlatform",
    "MlaKernelStandIn",
    "a_cuda_device",
    "a_cuda_platform_for_the_parser",
    "a_gpu_of_capability",
    "all_reduce_over_one_gpu",
    "compressed_tensors_mxfp4_kernel",
    "cuda_extensible_kv_cache",
    "cuda_graph_capture_sizes",
    "cuda_hybrid_kv_cache",
    "cuda_streams_and_events",
    "kda_prefill_kernel_of_the_gpu",
    "linear_kernels_on_their_gpu",
    "mla_attention_kernels",
    "mla_backend_stand_in",
    "moe_forward_on_cpu",
    "moe_kernel_of_the_gpu",
    "moe_kernels_on_their_gpu",
    "one_gpu_for_the_data_parallel_group",
    "online_method_quantizers",
    "runs_on_capability",
    "situ_and_mul_op_on_cpu",
    "sparse_mla_attention_kernels",
    "sparse_mla_backend_stand_in",
    "the_serving_gpus_capability",
    "triton_moe_forward_on_cpu",
    "vllm_without_its_package_initialiser",
    "weightless_model_loader",
    "whole_model_on_cpu",
]


@contextmanager
def whole_model_on_cpu() -> Iterator[None]:
    """The stand-ins the whole model needs, entered together."""
    with ExitStack() as stack:
        stack.enter_context(cuda_streams_and_events())
        stack.enter_context(mla_attention_kernels())
        stack.enter_context(sparse_mla_attention_kernels())
        stack.enter_context(linear_kernels_on_their_gpu())
        stack.enter_context(a_cuda_device())
        yield
