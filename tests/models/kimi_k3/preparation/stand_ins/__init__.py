"""What the preparation tests stand in for, the one place they fake anything:
the compiled ops, and the device calls, of each GPU kernel's weight
preparation.

vLLM's CUDA wheel on a CPU box loads no ``vllm._C`` (``No module named
'vllm._C'``), so ``torch.ops._C.*`` does not exist, and each kernel's
``process_weights_after_loading`` stops at its first compiled op or CUDA
call. Every other step of the preparation (pads, transposes, scale
permutations, swizzles, config rewrites) is vLLM's own Python and runs here
as on the GPU.

One module per kernel family, each with its own ledger entry per stand-in
(what the real op does, what the stand-in keeps of it): ``marlin`` (the
repacks, in the kernel's own tile order through vLLM's Python reference of
the op), ``deep_gemm`` (DeepGEMM's scale-factor transform and the device
question vLLM asks before it), ``flashinfer`` (FlashInfer's scale swizzle,
b12x's capture check and SM count, and the ``.cuda()`` of vLLM's own
swizzle), ``humming`` (its repack, a stand-in Hopper, and its tile
heuristics asked for a few token counts only: the one stand-in for pure
Python, there for time), ``online_quantizers`` (the online methods' GPU
quantizers, vLLM's static FP8 quantization among them, as vLLM's torch
references: they compute values; shared with
``plan``, which learns an online method's rule with them, so it lives in
``vllm_kimi_k3_moe.tools.meta_rank.stand_ins``),
``collectives`` (the all-reduce of online quantization's maxima over the
GPUs sharding a weight: a group of one; shared with ``plan`` too),
``torch_compile`` (compiled
functions run as their Python), ``weight_transfer`` (the device sync after
each bucket an engine receives; its transport, stood in by the update
tests). Each stand-in exists only inside
``on_cpu()`` (or, for what a weight loader asks of a GPU, ``loading()``)
and is removed on exit. A
stand-in for a repack or a layout transform (a pure rearrangement of the
same values into the kernel's order) keeps every value, so that a test can
read the tensor back in the layout it had before (each module's
``unrepacked``-style helpers) and see where each value went. A stand-in for
an op that computes new values says so, and the tests hold its output to
the loaded tensors, not to the stand-in's formula.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tests.models.kimi_k3.preparation.stand_ins import (
    deep_gemm,
    flashinfer,
    humming,
    marlin,
    torch_compile,
    weight_transfer,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import collectives, online_quantizers

FAMILIES = (
    marlin,
    deep_gemm,
    flashinfer,
    humming,
    online_quantizers,
    collectives,
    torch_compile,
    weight_transfer,
)


_active: list[None] = []  # on_cpu blocks entered and not left


@contextmanager
def on_cpu() -> Iterator[None]:
    """Every family's stand-ins, for the block (once, however nested: an
    online method may quantize and prepare while a rank is loaded, where the
    caller entered them, or after, where ``harness.PreparedOnCpu`` does)."""
    if _active:
        yield
        return
    with ExitStack() as stack:
        for family in FAMILIES:
            stack.enter_context(family.stand_ins())
        _active.append(None)
        try:
            yield
        finally:
            _active.pop()


@contextmanager
def loading() -> Iterator[None]:
    """What some methods' weight loaders ask of a GPU, while a rank is built
    and loaded: each family's ``loading()``, where it has one."""
    with ExitStack() as stack:
        for family in FAMILIES:
            if hasattr(family, "loading"):
                stack.enter_context(family.loading())
        yield
