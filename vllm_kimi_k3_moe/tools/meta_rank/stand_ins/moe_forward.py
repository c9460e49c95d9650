"""Stands in for the compiled ops and the CUDA driver query that vLLM's
batched reference MoE kernel (``NaiveBatchedExperts``: ``selftest`` on a
CPU, the forward-equivalence tests) needs from a GPU: ``_C::situ_and_mul``
and the CUDA-graph capture check; and ``_C::silu_and_mul``, which vLLM's
``SiluAndMul`` takes a handle of when built on ROCm (the DSpark draft).

Why: a CUDA wheel on a CPU box does not load ``vllm._C``, and there is no
CUDA driver to ask. What the real ones guarantee and is kept: the SiTU op is
computed by vLLM's own ``SituAndMul.forward_native``; nothing is captured on
a CPU, so only the compile half of the check is asked. Neither changes a
result.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes


def _situ_and_mul_on_cpu(out: Any, input: Any, beta: float, linear_beta: float) -> None:
    """``_C::situ_and_mul`` as vLLM's own ``SituAndMul.forward_native``
    computes it (``linear_beta <= 0`` means unset, as for the CUDA kernel)."""
    from vllm.model_executor.layers.activation import SituAndMul

    # Not SituAndMul(beta, linear_beta): a CustomOp's __init__ wants a current
    # VllmConfig to pick its dispatch; forward_native reads only the betas.
    activation = SituAndMul.__new__(SituAndMul)
    activation.beta = float(beta)
    activation.linear_beta = None if linear_beta <= 0 else float(linear_beta)
    out.copy_(SituAndMul.forward_native(activation, input))


# The library defining the op while a ``situ_and_mul_op_on_cpu`` block is
# entered: a block inside it (the MoE forward inside a layer's build on an
# AMD GPU stand-in) uses that definition.
_situ_defined: list[Any] = []


@contextmanager
def situ_and_mul_op_on_cpu() -> Iterator[None]:
    """vLLM's MoE activation (``apply_moe_activation``) calls
    ``torch.ops._C.situ_and_mul``, a CUDA kernel from ``vllm._C``, which a
    CUDA wheel on a CPU box does not load (``No module named 'vllm._C'``).
    The op is defined for the block with a CPU kernel that is vLLM's own
    pure-torch SiTU; the definition is removed again on exit. Holds no
    parameters."""
    import torch

    if _situ_defined:  # within another such block: defined there
        yield
        return
    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define(
            "situ_and_mul(Tensor! out, Tensor input, float beta, "
            "float linear_beta) -> ()"
        )
        library.impl("situ_and_mul", _situ_and_mul_on_cpu, "CPU")
        _situ_defined.append(library)
        yield
    finally:
        if _situ_defined and _situ_defined[-1] is library:
            _situ_defined.pop()
        library._destroy()


def _silu_and_mul_on_cpu(result: Any, input: Any) -> None:
    """``_C::silu_and_mul`` as vLLM's own ``SiluAndMul.forward_native``
    computes it."""
    from vllm.model_executor.layers.activation import SiluAndMul

    result.copy_(SiluAndMul.forward_native(input))


@contextmanager
def silu_and_mul_op_on_cpu() -> Iterator[None]:
    """``torch.ops._C.silu_and_mul``, which vLLM's ``SiluAndMul`` takes a
    handle of when built on a CUDA-like platform (the DSpark draft's MLPs on
    ROCm), defined for the block with vLLM's own pure-torch SiLU, where
    ``vllm._C`` does not define it; removed again on exit. Holds no
    parameters."""
    import torch

    if hasattr(torch.ops._C, "silu_and_mul"):
        yield
        return
    library = torch.library.Library("_C", "FRAGMENT")
    try:
        library.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
        library.impl("silu_and_mul", _silu_and_mul_on_cpu, "CPU")
        yield
    finally:
        library._destroy()


def _compiling_only() -> bool:
    import torch

    return torch.compiler.is_compiling()


@contextmanager
def moe_forward_on_cpu() -> Iterator[None]:
    """What vLLM's batched reference MoE kernel (``NaiveBatchedExperts``, the
    CPU path of ``selftest`` and of the forward-equivalence tests) needs from
    a GPU: the SiTU op (``situ_and_mul_op_on_cpu``), and an answer to
    ``fused_batched_moe._is_capturing_or_compiling``, which asks the CUDA
    driver whether a CUDA graph is being captured
    (``torch.accelerator.current_stream()`` raises without one): nothing is
    captured on a CPU, so only the compile half of the question is asked.
    Neither changes a result; both are put back on exit."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

    with (
        situ_and_mul_op_on_cpu(),
        replaced_attributes(
            fused_batched_moe, _is_capturing_or_compiling=_compiling_only
        ),
    ):
        yield
