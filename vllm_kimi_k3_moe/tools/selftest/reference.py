"""The unsharded Kimi-K3 experts in float64, and the inputs every rank gets.

The reference is plain torch from the checkpoint's tensors (dequantized to
FP32 by vLLM's helpers, ``dequantize``), with Kimi-K3's routing and SiTU
written out here from its published numbers, not read from vLLM: sigmoid
scores; the top-k of score + correction bias; their scores (without bias)
renormalized, times the scaling factor; ``SiTU(gate, up) = 4 tanh(gate/4)
sigmoid(gate) * 25 tanh(up/25)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kimi_k3_moe.tools.selftest.shape import MoeShape

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# Kimi-K3's published activation and routing (config.json text_config).
SITU_BETA = 4.0  # activation_situ_beta
SITU_LINEAR_BETA = 25.0  # activation_situ_linear_beta
ROUTED_SCALING_FACTOR = 1.0
# Decode batch sizes the forward is checked (and on a GPU timed) at; the
# smaller batches are the first tokens of the largest.
BATCH_SIZES = (1, 16, 128)
# Router logits of each token: this grid, shuffled. Kimi-K3 selects from
# the middle of it (top 16 of 32), where neighbouring sigmoid scores differ
# by ~0.06, far more than the correction bias (BIAS_SPREAD) moves them and
# than BF16 resolves (~0.004 there): a kernel that routes in BF16 or FP32
# picks the experts the float64 reference picks.
LOGIT_RANGE = 4.0
BIAS_SPREAD = 0.005

ExpertWeights = Callable[[int], "tuple[Tensor, Tensor]"]  # expert -> w13, w2


@dataclass(frozen=True)
class MoeInputs:
    """What every rank's routed experts get, on the harness's device: BF16
    values (what a GPU's activations hold) kept in FP32."""

    hidden: Tensor  # [tokens, width]
    logits: Tensor  # [tokens, experts], FP32 as Kimi-K3's gate gives them
    bias: Tensor  # [experts]: the router's correction bias

    def first(self, tokens: int) -> tuple[Tensor, Tensor]:
        return self.hidden[:tokens], self.logits[:tokens]


def moe_inputs(
    w13_of_one_expert: Tensor, shape: MoeShape, device: torch.device, seed: int = 0
) -> MoeInputs:
    """Hidden states scaled so that the gate and up projections are of order
    1 (SiTU not saturated, every weight matters), and the router's inputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = max(BATCH_SIZES)
    hidden = torch.randn(tokens, shape.width, generator=generator, dtype=torch.float64)
    row_norm = w13_of_one_expert.double().norm(dim=-1).mean().cpu()
    if not row_norm > 0:  # all-zero (or NaN) data: not scaled; run.judgeable
        row_norm = torch.ones((), dtype=torch.float64)
    hidden = (hidden * 2 / row_norm).to(torch.bfloat16).float()
    grid = torch.linspace(-LOGIT_RANGE, LOGIT_RANGE, shape.experts)
    logits = torch.stack(
        [
            grid[torch.randperm(shape.experts, generator=generator)]
            for _ in range(tokens)
        ]
    )
    bias = (torch.rand(shape.experts, generator=generator) - 0.5) * 2 * BIAS_SPREAD
    return MoeInputs(hidden.to(device), logits.to(device), bias.to(device))


def reference_routing(
    logits: Tensor, bias: Tensor, top_k: int
) -> tuple[Tensor, Tensor]:
    """Kimi-K3's routing: (weights, expert ids), [tokens, top_k] each."""
    scores = logits.double().sigmoid()
    ids = (scores + bias.double()).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True) * ROUTED_SCALING_FACTOR, ids


def situ(gate: Tensor, up: Tensor) -> Tensor:
    """Kimi-K3's SiTU with its published betas."""
    import torch

    gate = SITU_BETA * torch.tanh(gate / SITU_BETA) * torch.sigmoid(gate)
    return gate * SITU_LINEAR_BETA * torch.tanh(up / SITU_LINEAR_BETA)


def reference_output(
    expert_weights: ExpertWeights, inputs: MoeInputs, shape: MoeShape
) -> Tensor:
    """The unsharded routed experts' output for every token, in float64,
    one expert at a time (the whole layer in float64 would be 8 GB)."""
    hidden = inputs.hidden.double()
    weights, ids = reference_routing(inputs.logits, inputs.bias, shape.top_k)
    output = hidden.new_zeros(hidden.shape)
    for expert in range(shape.experts):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        w13, w2 = (w.double() for w in expert_weights(expert))
        gate, up = (hidden[token] @ w13.T).split(shape.intermediate, dim=-1)
        contribution = situ(gate, up) @ w2.T
        output.index_add_(0, token, contribution * weights[token, slot, None])
    return output


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius), NaN if any is."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())
