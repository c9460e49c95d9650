"""Every tensor a prepared layer's MoE kernel reads, and which of them hold
NaN or Inf.

A kernel reads the layer's parameters, the quantization config its method
made for it (``FusedMoEQuantConfig``: the scales, global scales, alphas and
zero points it is handed per activation and weight) and what its experts
object keeps (the TRT-LLM experts' per-expert SiTU constants, b12x's
prepared experts). A float8 or E8M0 byte is NaN by its bit pattern, not by
its torch dtype (MXFP4's E8M0 scales are viewed as float8_e4m3fn for the
TRT-LLM kernel): the caller says which bytes are NaN in each scale tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

E4M3_NAN_BYTES = (0x7F, 0xFF)  # S.1111.111
E8M0_NAN_BYTES = (0xFF,)


def _tensors_in(prefix: str, value: Any, found: dict[str, Any], depth: int) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel():
            found.setdefault(prefix, value)
        return
    if depth == 0 or value is None or isinstance(value, (str, int, float, bool)):
        return
    if dataclasses.is_dataclass(value):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        items = [(str(i), item) for i, item in enumerate(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        items = list(vars(value).items())
    else:
        return
    for name, item in items:
        _tensors_in(f"{prefix}.{name}", item, found, depth - 1)


def kernel_tensors(experts: Any) -> dict[str, Any]:
    """name -> tensor, for everything the prepared layer's kernel reads."""
    found = dict(experts.named_parameters(recurse=False))
    found |= dict(experts.named_buffers(recurse=False))
    method = experts.quant_method
    kernel = getattr(method, "moe_kernel", None)
    fused = getattr(kernel, "fused_experts", None)
    for name, value in (
        ("quant_config", getattr(method, "moe_quant_config", None)),
        ("experts", fused),
        ("prepared", getattr(experts, "_b12x_prepared_experts", None)),
    ):
        _tensors_in(name, value, found, depth=3)
    return found


def nonfinite(tensors: dict[str, Any], coded: dict[Any, tuple[int, ...]]) -> list:
    """The names of the tensors holding NaN or Inf: by value, but the 8-bit
    scales in ``coded`` (tensor -> its NaN bytes), and any other name for
    their storage, by their bytes."""
    import torch

    bytes_at = {tensor.data_ptr(): nan for tensor, nan in coded.items()}
    bad, seen = [], set()
    for name, tensor in tensors.items():
        if tensor.data_ptr() in seen:  # another name for the same storage
            continue
        seen.add(tensor.data_ptr())
        if tensor.data_ptr() in bytes_at:
            codes = tensor.view(torch.uint8)
            if any(bool((codes == b).any()) for b in bytes_at[tensor.data_ptr()]):
                bad.append(name)
        elif tensor.dtype.is_floating_point and not bool(
            torch.isfinite(tensor.float()).all()
        ):
            bad.append(name)
    return bad
