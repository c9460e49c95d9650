"""What vLLM's Triton MoE GEMM assumes about the tensors a preparation hands
it.

``TritonExperts`` (fused_moe/experts/triton_moe.py) runs
``fused_moe_kernel`` (fused_moe/fused_moe.py) twice on ``B = [experts, n,
k]`` (w13: n = 2 x the rows, k = the expert width; w2: n = the width, k =
the rows), with the weight scales and block shape of its quantization
config; read from ``invoke_fused_moe_triton_kernel`` and the kernel:

- FP8 in blocks ``[bn, bk]`` (``block_shape``): the host asserts
  ``cdiv(n, bn) == B_scale.size(-2)`` and ``cdiv(k, bk) == B_scale.size(-1)``;
  the kernel reads output row r's scale at row ``r // bn`` (``offs_bsn =
  offs_bn // group_n``) of w13's 2 x rows, so up's first row starts a block
  of its own only where the rows are a whole number of blocks; the
  activations are quantized in groups of bk along k
  (``per_token_group_quant_fp8`` asserts k % bk == 0);
- FP8 per output channel (``per_act_token_quant``, per-token activations):
  one scale per row of B, read at ``expert * stride(0) + row * stride(1)``
  (``B_scale.stride(1)``): ``[experts, n, 1]``;
- BF16: no scale; n and k tails are masked, so any sizes.

(FP8 per tensor, one scale per expert, reaches no Kimi-K3 config on
Triton.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TritonGemm:
    """One of a layer's two GEMMs as prepared for Triton."""

    name: str  # "w13" or "w2"
    weight: Any  # [experts, n, k]
    scales: Any = None  # the quantization config's w1_scale / w2_scale
    block_shape: tuple[int, int] | None = None
    per_channel: bool = False
    gated: bool = False  # w13: gate then up along n

    def problems(self) -> list[str]:
        """Where the prepared GEMM breaks what the kernel assumes."""
        import torch

        experts, n, k = self.weight.shape
        where = f"{self.name} (n {n}, k {k})"
        if self.scales is None:
            return []
        found = []
        scales = self.scales
        if self.block_shape is not None:
            bn, bk = self.block_shape
            expected = (experts, _cdiv(n, bn), _cdiv(k, bk))
            if self.gated and (n // 2) % bn:
                found.append(f"{where}: up's rows do not start a block of {bn}")
            if k % bk:
                found.append(f"{where}: k is not a whole number of {bk} groups")
        elif self.per_channel:
            expected = (experts, n, 1)
        else:
            return [f"{where}: FP8 per tensor, which this contract does not read"]
        if tuple(scales.shape) != expected:
            found.append(f"{where}: scales {tuple(scales.shape)}, expected {expected}")
        elif not torch.isfinite(scales.float()).all():
            found.append(f"{where}: scales not finite")
        return found
