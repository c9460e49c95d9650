"""FlashInfer's compiled scale swizzle and the device calls of the NVFP4,
MXFP4 and CUTLASS preparations, kept as values.

``flashinfer.block_scale_interleave`` (alias ``nvfp4_block_scale_interleave``)
    flashinfer/quantization/fp4_quantization.py: picks the JIT module for
    the tensor's GPU (``get_compute_capability``), then its
    ``block_scale_interleave_sm100`` kernel (csrc nv_internal/cpp/kernels/
    quantization.cu) writes a ``[..., rows, cols]`` scale matrix to one flat
    buffer, element (b, m, k) at ``get_sf_out_offset_128x4`` (csrc
    nv_internal/tensorrt_llm/kernels/quantization_utils.cuh): rows padded to
    128 and columns to 4 with zeros, tiles of 128 x 4. FlashInfer's
    registered fake gives ``rows * cols // 16`` elements, not that size, so
    it cannot stand in. The stand-in writes the same offsets (``offsets``);
    ``unswizzled`` reads a swizzled matrix back. vLLM's own torch swizzle
    (``nvfp4_utils.swizzle_blockscale``, CUTLASS and CuteDSL) is not stood
    in: the tests read it back with the same ``unswizzled``, i.e. against
    FlashInfer's kernel formula.
``torch.Tensor.cuda``
    ``swizzle_blockscale`` ends with ``.cuda()``: on a GPU a no-op for a
    tensor already there. The stand-in returns the tensor.
``torch.accelerator.current_device_index``
    the TRT-LLM experts' constructors (``trtllm_nvfp4_moe``,
    ``trtllm_mxfp4_moe``) put their per-expert SiTU constants on the current
    device: ``"cpu"`` here.
``torch.cuda.get_device_properties`` (b12x's ``_make_workspace``)
    b12x's MXFP4 preparation (``prepare_w4a16_fp4_e8m0_k32_weights``) sizes
    a zeroed int32 scratch buffer by the GPU's SM count; it holds no weight.
    The stand-in answers a B200's 148 SMs.
``fused_moe.b12x._is_current_stream_capturing``
    ``B12xExperts`` refuses to prepare weights while a CUDA graph is being
    captured, asking the CUDA driver (``torch.cuda.is_current_stream_capturing``,
    which fails without one). Nothing is captured on a CPU: False.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vllm.utils.math_utils import round_up

from vllm_kimi_k3_moe.patching import replaced_attributes

SF_ROW_TILE = 128  # rows of one 128 x 4 scale tile
SF_COL_TILE = 4  # scale columns of one tile


def offsets(rows: int, cols: int) -> Any:
    """``get_sf_out_offset_128x4(m, k)`` for every (m, k) of a ``rows x
    cols`` scale matrix, an int64 ``[rows, cols]`` tensor (one matrix: the
    batch stride is the padded matrix's size)."""
    import torch

    m = torch.arange(rows).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    k_tiles = round_up(cols, SF_COL_TILE) // SF_COL_TILE
    return (
        (m // 128) * (k_tiles * 512)
        + (k // 4) * 512
        + (m % 32) * 16
        + ((m % 128) // 32) * 4
        + (k % 4)
    )


def padded_size(rows: int, cols: int) -> int:
    return round_up(rows, SF_ROW_TILE) * round_up(cols, SF_COL_TILE)


def _block_scale_interleave(unswizzled_sf: Any, *, out: Any = None) -> Any:
    import torch

    matrices = unswizzled_sf.reshape(-1, *unswizzled_sf.shape[-2:])
    batch, rows, cols = matrices.shape
    size = padded_size(rows, cols)
    flat = torch.zeros(batch, size, dtype=unswizzled_sf.dtype)
    flat[:, offsets(rows, cols).reshape(-1)] = matrices.reshape(batch, -1)
    flat = flat.reshape(-1)
    if out is not None:
        out.copy_(flat)
        return out
    return flat


def unswizzled(swizzled: Any, rows: int, cols: int) -> Any:
    """128 x 4-swizzled scale matrices (``padded_size`` elements each, one
    after another in any shape) read back as ``[matrices, rows, cols]``; the
    pads are left out (``pads_of`` reads them)."""
    flat = swizzled.reshape(-1, padded_size(rows, cols))
    return flat[:, offsets(rows, cols).reshape(-1)].reshape(-1, rows, cols)


def pads_of(swizzled: Any, rows: int, cols: int) -> Any:
    """The elements of a swizzled scale matrix that hold no (m, k): the
    swizzle's own zero pad (rows to 128, columns to 4)."""
    import torch

    flat = swizzled.reshape(-1, padded_size(rows, cols))
    keep = torch.ones(flat.shape[1], dtype=torch.bool)
    keep[offsets(rows, cols).reshape(-1)] = False
    return flat[:, keep]


def _identity(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


B200_SMS = 148


def _b200(device: Any = None) -> Any:
    """What b12x reads of ``torch.cuda.get_device_properties``."""
    from types import SimpleNamespace

    return SimpleNamespace(multi_processor_count=B200_SMS)


@contextmanager
def stand_ins() -> Iterator[None]:
    """The swizzle wherever vLLM imports it from, ``.cuda()``, the current
    device and b12x's capture check, for the block. FlashInfer (a long
    import) is stood in only where a kernel built here imported it, and b12x
    only where a b12x kernel was built: vLLM imports both when it selects
    one of their kernels."""
    import torch

    names = ("block_scale_interleave", "nvfp4_block_scale_interleave")
    with ExitStack() as stack:
        if "flashinfer" in sys.modules:
            import flashinfer
            import flashinfer.fp4_quantization
            import flashinfer.quantization.fp4_quantization

            for module in (
                flashinfer,
                flashinfer.fp4_quantization,
                flashinfer.quantization.fp4_quantization,
            ):
                swizzles = {
                    n: _block_scale_interleave for n in names if hasattr(module, n)
                }
                stack.enter_context(replaced_attributes(module, **swizzles))
        b12x = sys.modules.get("vllm.model_executor.layers.fused_moe.b12x")
        if b12x is not None:
            stack.enter_context(
                replaced_attributes(b12x, _is_current_stream_capturing=lambda: False)
            )
        stack.enter_context(
            replaced_attributes(torch.cuda, get_device_properties=_b200)
        )
        stack.enter_context(replaced_attributes(torch.Tensor, cuda=_identity))
        stack.enter_context(
            replaced_attributes(torch.accelerator, current_device_index=lambda: "cpu")
        )
        yield
