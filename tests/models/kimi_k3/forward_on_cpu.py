"""Kimi-K3's routed experts computed on a CPU: every rank through vLLM's own
MoE forward, and the unsharded experts the ranks must add up to.

What runs is vLLM 0.33.0's: the layer each rank builds and loads (its
``KimiMoE``, quantization method and weight loader), its router (Kimi-K3's
sigmoid scores with the correction bias, top-k, renormalized), the layer's
``FusedMoEConfig`` (SiTU with the betas the layer was built with) and vLLM's
reference modular kernel, ``FusedMoEKernel(BatchedPrepareAndFinalize,
NaiveBatchedExperts)``. A quantized rank's weights are dequantized with
vLLM's own helpers first (its GPU kernels, Marlin and the rest, do not run on
a CPU), so the kernel computes in FP32.

The reference is plain torch in float64 from the checkpoint's tensors (with
the same vLLM helpers for dequantization), with Kimi-K3's routing and SiTU
written out here from its published numbers, not read from vLLM.

Stand-ins (``gpu_stand_ins.moe_forward_on_cpu``) replace only what a CPU box
lacks, each for the duration of a ``with`` block, holding nothing that
changes a result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tests.models.kimi_k3.builders import routed_experts
from tests.models.kimi_k3.format_checkpoints import write_format_checkpoint_with_data
from tests.models.kimi_k3.gpu_stand_ins import (
    moe_forward_on_cpu,
    uninitialised_memory_reads,
)
from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    expert_tensor_name,
    expert_tensor_shape,
    split_into_shards,
    write_checkpoint,
)
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.tools.build.rank import Rank, simulated_rank
from vllm_kimi_k3_moe.tools.build.stand_ins import moe_kernels_on_their_gpu
from vllm_kimi_k3_moe.tools.build.vllm_config import rank_vllm_config
from vllm_kimi_k3_moe.tools.topology import Topology

# Kimi-K3's published activation and routing (config.json text_config).
SITU_BETA = 4.0  # activation_situ_beta: gate -> 4 tanh(gate / 4) sigmoid(gate)
SITU_LINEAR_BETA = 25.0  # activation_situ_linear_beta: up -> 25 tanh(up / 25)
ROUTED_SCALING_FACTOR = 1.0
# One MoE layer (1) of four experts, top-2, hidden 256 (what the experts
# see); the real intermediate size 3072, so TP16 gives 192 rows per rank and
# TP32 96.
SPEC = KimiK3Spec(num_experts=4, num_hidden_layers=2, num_nextn_predict_layers=0)
LAYER = 1
HIDDEN = SPEC.routed_expert_hidden_size
INTERMEDIATE = SPEC.moe_intermediate_size
TOP_K = SPEC.num_experts_per_token
NUM_TOKENS = 8  # every expert gets tokens
ROUTED_EXPERTS = ".block_sparse_moe.experts."
# Where the relative error of the ranks' sum is held: FP32 arithmetic in a
# different summation order than the float64 reference, nothing more.
TOLERANCE = 1e-5
# MXFP4 scale bytes (E8M0, 127 is 2^0): 2^-3 .. 2^0, so every dequantized
# weight and every product stays finite (the suite's other MXFP4 checkpoints
# use bytes 1..255, whose 2^127 scales overflow FP32 in a matmul).
MXFP4_SCALE_BYTES = (124, 128)
NAN_BYTE = 0xFF  # NaN in bf16, fp32, fp8 e4m3 and e8m0 alike


# --- checkpoints -------------------------------------------------------------


def _mxfp4_tensor(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    low, high = (0, 256) if name.endswith("weight_packed") else MXFP4_SCALE_BYTES
    return torch.randint(low, high, shape, generator=generator, dtype=torch.uint8)


def write_mxfp4_checkpoint(directory: Path, fmt: str) -> dict[str, Tensor]:
    """``SPEC``'s MXFP4 checkpoint with data: the release's compressed-tensors
    ``mxfp4-pack-quantized`` (``fmt`` ``mxfp4``, which vLLM rewrites to native
    MXFP4) or another compressed-tensors MXFP4 (``ct-mxfp4``)."""
    tensors = {}
    seed = 0
    for expert in range(SPEC.num_experts):
        for projection in ("w1", "w3", "w2"):
            for suffix in ("weight_packed", "weight_scale"):
                name = expert_tensor_name(LAYER, expert, projection, suffix)
                shape = expert_tensor_shape(SPEC, projection, suffix)
                tensors[name] = _mxfp4_tensor(name, shape, seed)
                seed += 1
    config = SPEC.config()  # the release's quantization_config
    if fmt == "ct-mxfp4":
        config["quantization_config"] = QUANTIZATION_CONFIGS[fmt]
    write_checkpoint(directory, SPEC, split_into_shards(tensors, SPEC.shards), config)
    return tensors


def write_checkpoint_with_data(directory: Path, fmt: str) -> dict[str, Tensor]:
    """A small ``fmt`` checkpoint with seeded, finite data; its tensors."""
    if fmt in ("mxfp4", "ct-mxfp4"):
        return write_mxfp4_checkpoint(directory, fmt)
    return write_format_checkpoint_with_data(directory, fmt, SPEC)


# --- loading every rank ------------------------------------------------------


def load_ranks(
    directory: Path,
    moe_layers_only_model: Callable[..., nn.Module],
    kimi_moe_cls: type,
    tp_size: int,
    uninitialised_byte: int | None = None,
) -> list[nn.Module]:
    """Every TP rank's ``KimiMoE`` of layer ``LAYER`` (``kimi_moe_cls``: the
    plugin's or vLLM alone's), built from the checkpoint's config and loaded
    as vLLM's default loader loads it (Marlin where the format has it, Triton
    for BF16, as ``--moe-backend marlin``). With ``uninitialised_byte``,
    uninitialised memory reads as that byte while the layers are built and
    loaded; without, as whatever the CPU hands out."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    ranks = []
    for rank in range(tp_size):
        with (
            simulated_rank(Rank(Topology(tp_size), tp_rank=rank)),
            moe_kernels_on_their_gpu(),
            ExitStack() as memory,
        ):
            if uninitialised_byte is not None:
                memory.enter_context(uninitialised_memory_reads(uninitialised_byte))
            vllm_config = rank_vllm_config(directory, Topology(tp_size), "marlin")
            model = moe_layers_only_model(vllm_config, kimi_moe_cls)
            loader = DefaultModelLoader(LoadConfig())
            weights = loader.get_all_weights(vllm_config.model_config, model)
            AutoWeightsLoader(model).load_weights(
                ((name, w) for name, w in weights if ROUTED_EXPERTS in name),
                mapper=KimiK3ForConditionalGeneration.hf_to_vllm_mapper,
            )
        ranks.append(model.language_model.model.layers[LAYER].block_sparse_moe)
    return ranks


# --- dequantization, with vLLM's own helpers ---------------------------------

Weights = tuple[Tensor, Tensor]  # w13 [E, 2n, H] (gate rows, then up), w2 [E, H, n]


def _mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    from vllm.third_party.triton_kernels.numerics_details.mxfp import (
        upcast_from_mxfp_torch,
    )

    return upcast_from_mxfp_torch(packed, scale, torch.float32, axis=-1)


def _fp8_block(weight: Tensor, scale: Tensor) -> Tensor:
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
    )

    return scaled_dequantize(weight, scale, GroupShape(128, 128), torch.float32)


def _nvfp4(*tensors: Tensor, ct: bool) -> Weights:
    """``tensors``: w13's packed weight, block scales and global scales, then
    w2's."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_nvfp4_moe_weights,
    )

    # compressed-tensors stores the global encode scale, ModelOpt its inverse
    return dequantize_nvfp4_moe_weights(
        *tensors, torch.float32, invert_global_scales=ct
    )


def _w4a16(w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor) -> Weights:
    # What vLLM's W4A16 emulation backend does to a compressed-tensors
    # checkpoint's N-first weights: unpack the int4 (offset 8) and scale them.
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
        _process_weights_emulation_gptq,
    )

    dequantized = _process_weights_emulation_gptq(
        w13, w2, w13_scale, w2_scale, None, None
    )
    return dequantized[0].float(), dequantized[1].float()


# Per format, the layer parameters (``w13_{suffix}``, ``w2_{suffix}``) a
# rank's experts are computed from: the weight first, then its scales.
PARAMETER_SUFFIXES = {
    "mxfp4": ("weight", "weight_scale"),  # native MXFP4 renames weight_packed
    "ct-mxfp4": ("weight_packed", "weight_scale"),
    "fp8-block": ("weight", "weight_scale"),
    "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
    "modelopt-nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "w4a16": ("weight_packed", "weight_scale"),
    "bf16": ("weight",),
}
# The published formats with a CPU path: all of them. What has none is each
# format's GPU kernel (Marlin, CUTLASS, FlashInfer, DeepGEMM, ...).
FORMATS = tuple(PARAMETER_SUFFIXES)


def dequantize(fmt: str, tensors: dict[str, Tensor]) -> Weights:
    """FP32 ``w13``/``w2`` from ``fmt``'s parameters, with vLLM's helpers."""
    w13, w2 = (
        [tensors[f"{prefix}_{suffix}"] for suffix in PARAMETER_SUFFIXES[fmt]]
        for prefix in ("w13", "w2")
    )
    if fmt == "bf16":
        return w13[0].float(), w2[0].float()
    if fmt in ("mxfp4", "ct-mxfp4"):
        return _mxfp4(*w13), _mxfp4(*w2)
    if fmt == "fp8-block":
        return _fp8_block(*w13), _fp8_block(*w2)
    if fmt in ("nvfp4", "modelopt-nvfp4"):
        return _nvfp4(*w13, *w2, ct=fmt == "nvfp4")
    if fmt == "w4a16":
        return _w4a16(w13[0], w2[0], w13[1], w2[1])
    raise ValueError(f"no CPU path for {fmt!r}")


def rank_weights(fmt: str, experts: nn.Module) -> Weights:
    """A rank's loaded routed experts (``RoutedExperts``), pads included,
    dequantized to FP32."""
    return dequantize(fmt, {n: p.data for n, p in experts.named_parameters()})


def checkpoint_weights(fmt: str, tensors: dict[str, Tensor]) -> Weights:
    """The unsharded experts, dequantized to FP32 from the checkpoint's
    tensors alone: each expert's w1 rows, then its w3 rows, as ``w13``; a
    per-tensor value of w1 next to w3's."""
    parameters = {}
    for suffix in PARAMETER_SUFFIXES[fmt]:
        stored = "weight_packed" if (fmt, suffix) == ("mxfp4", "weight") else suffix

        def of(expert: int, projection: str, stored: str = stored) -> Tensor:
            return tensors[expert_tensor_name(LAYER, expert, projection, stored)]

        experts = range(SPEC.num_experts)
        if of(0, "w1").dim() == 2:  # a matrix, split over the ranks
            w13 = [torch.cat([of(e, "w1"), of(e, "w3")]) for e in experts]
            w2 = [of(e, "w2") for e in experts]
        else:  # a per-tensor value
            w13 = [
                torch.cat([of(e, p).reshape(1) for p in ("w1", "w3")]) for e in experts
            ]
            w2 = [of(e, "w2").reshape(()) for e in experts]
        parameters[f"w13_{suffix}"] = torch.stack(w13)
        parameters[f"w2_{suffix}"] = torch.stack(w2)
    return dequantize(fmt, parameters)


# --- the inputs --------------------------------------------------------------


def moe_inputs(w13: Tensor, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states, router logits and the router's correction bias. The
    hidden states are scaled so that the gate and up projections are of
    order 1, where SiTU is not saturated and every weight matters."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    row_norm = w13.double().norm(dim=-1).mean()
    hidden = (hidden * 2 / row_norm).float()
    logits = torch.randn(NUM_TOKENS, SPEC.num_experts, generator=generator)
    bias = torch.randn(SPEC.num_experts, generator=generator) * 0.1
    return hidden, logits, bias


# --- vLLM's forward, one rank ------------------------------------------------


@functools.cache
def _unquantized() -> object:
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
    )

    return FUSED_MOE_UNQUANTIZED_CONFIG


def rank_output(
    fmt: str, moe: nn.Module, hidden: Tensor, logits: Tensor, bias: Tensor
) -> Tensor:
    """One rank's routed-expert output for ``hidden`` (before the all-reduce),
    through vLLM: the layer's router picks and weighs the experts, vLLM's
    batched reference kernel runs the rank's dequantized experts with the
    layer's own activation config (SiTU and its betas)."""
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        NaiveBatchedExperts,
    )
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import (
        BatchedPrepareAndFinalize,
    )

    experts = routed_experts(moe)
    w13, w2 = rank_weights(fmt, experts)
    moe.gate.e_score_correction_bias.data.copy_(bias)  # as a checkpoint sets it
    topk_weights, topk_ids = moe.experts.router.select_experts(
        hidden_states=hidden, router_logits=logits
    )
    config = experts.moe_config
    kernel = FusedMoEKernel(
        BatchedPrepareAndFinalize(
            max_num_tokens=NUM_TOKENS,
            num_local_experts=experts.local_num_experts,
            num_dispatchers=1,
            rank=0,
        ),
        NaiveBatchedExperts(
            moe_config=config,
            quant_config=_unquantized(),
            max_num_tokens=NUM_TOKENS,
            num_dispatchers=1,
        ),
    )
    with moe_forward_on_cpu():
        return kernel.apply(
            hidden_states=hidden,
            w1=w13,
            w2=w2,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            activation=config.activation,
            global_num_experts=SPEC.num_experts,
            expert_map=None,
            apply_router_weight_on_input=False,
        )


def all_reduced_output(
    fmt: str, ranks: list[nn.Module], hidden: Tensor, logits: Tensor, bias: Tensor
) -> Tensor:
    """The ranks' outputs summed, as the TP all-reduce sums them."""
    outputs = [rank_output(fmt, moe, hidden, logits, bias) for moe in ranks]
    return torch.stack(outputs).sum(dim=0)


# --- the reference: plain torch ----------------------------------------------


def reference_routing(logits: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Kimi-K3's routing: sigmoid scores; the top-k of score + correction
    bias; their scores (without bias) renormalized, times the scaling factor."""
    scores = logits.double().sigmoid()
    ids = (scores + bias.double()).topk(TOP_K, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True) * ROUTED_SCALING_FACTOR, ids


def situ(gate: Tensor, up: Tensor) -> Tensor:
    """Kimi-K3's SiTU with its published betas."""
    gate = SITU_BETA * torch.tanh(gate / SITU_BETA) * torch.sigmoid(gate)
    return gate * SITU_LINEAR_BETA * torch.tanh(up / SITU_LINEAR_BETA)


def reference_output(
    weights: Weights, hidden: Tensor, logits: Tensor, bias: Tensor
) -> Tensor:
    """The unsharded routed experts, in float64, token by token."""
    w13, w2 = (w.double() for w in weights)
    routing_weights, ids = reference_routing(logits, bias)
    output = torch.zeros(NUM_TOKENS, HIDDEN, dtype=torch.float64)
    for token in range(NUM_TOKENS):
        x = hidden[token].double()
        for weight, expert in zip(routing_weights[token], ids[token], strict=True):
            gate, up = (w13[expert] @ x).split(INTERMEDIATE)
            output[token] += weight * (w2[expert] @ situ(gate, up))
    return output


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius), NaN if any is."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


# --- what the tests call -----------------------------------------------------


@dataclass(frozen=True)
class ForwardCase:
    """A written checkpoint, the inputs of the forward and the reference."""

    fmt: str
    directory: Path
    hidden: Tensor
    logits: Tensor
    bias: Tensor
    expected: Tensor  # the unsharded experts' output (float64)


def forward_case(directory: Path, fmt: str) -> ForwardCase:
    """Write ``fmt``'s checkpoint to ``directory`` and compute its reference."""
    weights = checkpoint_weights(fmt, write_checkpoint_with_data(directory, fmt))
    hidden, logits, bias = moe_inputs(weights[0])
    expected = reference_output(weights, hidden, logits, bias)
    return ForwardCase(fmt, directory, hidden, logits, bias, expected)


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run torch on one thread: at these tiny shapes, on a small machine
    shared with other work, two OpenMP threads waiting on each other make
    loading and the forward several times slower. Results are checked to a
    tolerance, and bit-for-bit comparisons run under the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def deployment_output(
    case: ForwardCase,
    moe_layers_only_model: Callable[..., nn.Module],
    kimi_moe_cls: type,
    tp_size: int,
    uninitialised_byte: int | None = None,
) -> Tensor:
    """Load ``case``'s checkpoint into every rank of TP ``tp_size`` (see
    ``load_ranks``), run each rank's forward and sum them, as the
    all-reduce does."""
    with one_cpu_thread():
        ranks = load_ranks(
            case.directory,
            moe_layers_only_model,
            kimi_moe_cls,
            tp_size,
            uninitialised_byte,
        )
        return all_reduced_output(case.fmt, ranks, case.hidden, case.logits, case.bias)
