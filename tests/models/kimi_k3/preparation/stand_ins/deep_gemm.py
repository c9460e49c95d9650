"""DeepGEMM's compiled scale-factor transform, kept as values, and the device
query that decides how vLLM calls it.

``transform_sf_into_required_layout`` (vLLM's ``utils.deep_gemm`` calls
DeepGEMM's through ``_transform_sf_into_required_layout_impl``)
    DeepGEMM csrc/apis/layout.hpp (a newer snapshot than the 2.8.1 vLLM
    vendors; the branch below is the same in both as far as vLLM's call
    shows): it checks the FP32 scales' shape against ``mn``, ``k`` and the
    recipe (``check_sf_layout``: ``[groups, ceil(mn / gran_mn), ceil(k /
    gran_k)]``) and, on SM100 and SM120 for K groups of 32 or 128 (MXFP4's
    weight scales: recipe (1, 1, 32)), asserts ``not disable_ue8m0_cast``,
    broadcasts ``gran_mn`` rows, and packs them
    (``get_mn_major_tma_aligned_packed_ue8m0_tensor``,
    csrc/jit_kernels/impls/smxx_layout.hpp): each FP32 scale's exponent byte
    (UE8M0; the scales vLLM hands it are E8M0 bytes moved into the exponent,
    ``fp8_utils._upcast_e8m0_to_fp32``, so nothing is lost), K padded with
    zero bytes to a multiple of 4, four bytes per int32 (K group 4i+j in byte
    j), laid out MN-major with the MN stride TMA-aligned (``[groups, mn,
    ceil(k_groups / 4)]``, strides ``(aligned_mn * packed_k, 1, aligned_mn)``,
    ``aligned_mn`` a multiple of 16 bytes' int32s: ``get_tma_aligned_size``).
    The stand-in does the same, packing with DeepGEMM's own Python
    ``utils.math.pack_ue8m0_to_int`` (which also asserts that every scale is
    a power of two); a byte view of the int32s reads it back
    (``deep_gemm_kernel``).

``is_deep_gemm_e8m0_used`` (as ``vllm.utils.deep_gemm``'s wrapper of the
transform reads it)
    Whether the GPU is a Hopper or Blackwell with DeepGEMM and
    ``VLLM_USE_DEEP_GEMM_E8M0`` (the default) set: a CPU has no such GPU and
    answers no, which would make the transform refuse (``disable_ue8m0_cast``).
    Answered as on the SM100/SM120 GPUs DeepGEMM's MXFP4 kernel runs on: the
    environment variable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TMA_ALIGNMENT_BYTES = 16  # get_tma_aligned_size's kNumTMAAlignmentBytes
UE8M0_PER_INT = 4  # UE8M0 bytes per packed int32
PACKED_GRANULARITIES = (32, 128)  # K groups SM100/SM120 pack into UE8M0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tma_aligned(mn: int, element_size: int) -> int:
    """``get_tma_aligned_size``: ``mn`` rounded up to 16 bytes of elements."""
    step = TMA_ALIGNMENT_BYTES // element_size
    return _ceil_div(mn, step) * step


def _packed_ue8m0(sf: Any) -> Any:
    """``get_mn_major_tma_aligned_packed_ue8m0_tensor`` of FP32 scales."""
    import torch
    from vllm.third_party.deep_gemm.utils.math import pack_ue8m0_to_int

    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    groups, mn, sf_k = batched.shape
    packed_k = _ceil_div(sf_k, UE8M0_PER_INT)
    padded = torch.nn.functional.pad(batched, (0, packed_k * UE8M0_PER_INT - sf_k))
    values = pack_ue8m0_to_int(padded.contiguous())  # [groups, mn, packed_k]
    aligned = tma_aligned(mn, values.element_size())
    out = torch.empty_strided(
        (groups, mn, packed_k), (aligned * packed_k, 1, aligned), dtype=torch.int32
    )
    out.copy_(values)
    return out if sf.dim() == 3 else out.squeeze(0)


def _transform_sf_into_required_layout(
    sf: Any,
    mn: int,
    k: int,
    recipe: tuple[int, ...],
    num_groups: int | None = None,
    is_sfa: bool | None = None,
    disable_ue8m0_cast: bool = False,
    psum_layout: Any = None,
) -> Any:
    import torch

    if len(recipe) == 3:
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    else:
        gran_mn, gran_k = recipe
    assert sf.dtype == torch.float32, sf.dtype
    assert sf.dim() == 2 + (num_groups is not None), tuple(sf.shape)
    if num_groups is not None:
        assert sf.shape[-3] == num_groups, (tuple(sf.shape), num_groups)
    assert sf.shape[-2] == _ceil_div(mn, gran_mn), (tuple(sf.shape), mn, gran_mn)
    assert sf.shape[-1] == _ceil_div(k, gran_k), (tuple(sf.shape), k, gran_k)
    assert gran_k in PACKED_GRANULARITIES, f"no SM100/SM120 transform for {recipe}"
    assert not disable_ue8m0_cast, "SM100/SM120 pack FP32 scales into UE8M0"
    assert psum_layout is None, "weights have no PSUM layout"
    if gran_mn != 1:
        rows = torch.arange(mn) // gran_mn
        sf = sf.index_select(-2, rows)
    return _packed_ue8m0(sf)


def _e8m0_used() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_USE_DEEP_GEMM_E8M0)


@contextmanager
def stand_ins() -> Iterator[None]:
    """The transform, and the E8M0 question, for the block."""
    import vllm.utils.deep_gemm as deep_gemm

    from vllm_kimi_k3_moe.patching import replaced_attributes

    with replaced_attributes(
        deep_gemm,
        _transform_sf_into_required_layout_impl=_transform_sf_into_required_layout,
        is_deep_gemm_e8m0_used=_e8m0_used,
    ):
        yield
