"""Run ranks' Kimi-K3 experts through vLLM's Triton MoE kernel, interpreted
(``python -m tests.models.kimi_k3.triton_interpreted_ranks RESULTS``: cases
as JSON on stdin, one JSON object of results written to the file RESULTS).

A process of its own because Triton's interpreter must be chosen before
Triton and vLLM are imported (``interpreted_triton.interpret_triton``: the
first thing this module does when run as a program), which a pytest process
that has imported vLLM for other tests cannot undo; ``test_triton_interpreted``
starts it once a session.

Each case is one GPU of a layout serving a config on ``--moe-backend
triton``: built through the plugin and loaded as the selftest builds and
loads it (``harness.loaded_rank``), every byte of memory nobody wrote
reading 0xFF (NaN in BF16, FP32 and FP8) while it is built and loaded, then
prepared and run by ``InterpretedTriton`` (vLLM's ``TritonExperts``: its
``fused_moe_kernel`` and Triton activation quantization, interpreted) on
``TOKENS`` tokens. Its output is compared with its share of the unsharded
experts in float64, computed here in plain torch from the checkpoint's
tensors (for FP8, the GEMMs' inputs rounded to FP8 as the format defines:
``as_fp8_activations``): rows ``[start, end)`` of every expert, or, with
expert parallelism, its own whole experts. It also reports the prepared
weights past the rows the GPU holds, which the kernel multiplies through
(``pad_weights``).
"""

from __future__ import annotations

if __name__ == "__main__":  # before anything imports Triton or vLLM
    from vllm_kimi_k3_moe.tools.selftest.interpreted_triton import interpret_triton

    interpret_triton()

import functools
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Tokens each rank runs: all of the layer's experts routed to, a few blocks
# of the kernel's M tiles (the interpreter runs one program at a time).
TOKENS = 8
# The experts' width: one FP8 block of 128 (w13's K, w2's N). The kernel's
# tiles and masks along the rows (the partition) are what is under test.
WIDTH = 128
EXPERTS = 4
TOP_K = 2
BLOCK = 128  # FP8 weight blocks are 128 x 128
# How each config's kernel quantizes a GEMM's input activations to FP8 before
# it multiplies (the format's, not vLLM's code): one scale per token and
# group of this many columns (per-token-group for FP8 blocks, per token for
# FP8 per channel: the whole row); BF16 is not quantized.
ACTIVATION_GROUP = {"bf16": None, "fp8-block": BLOCK, "ct-fp8-channel": 1 << 30}
FP8_MAX = 448.0  # float8_e4m3fn's largest value


@functools.cache
def _layer(config: str, experts: int) -> Any:
    """The synthetic layer (``PreparedLayer``, no reference: each rank's
    share is computed per rank) every rank of ``config`` loads."""
    import torch

    from tests.models.kimi_k3.preparation.harness import (
        FEW_EXPERTS,
        PreparationCase,
        checkpoint_format,
    )
    from vllm_kimi_k3_moe.tools.deployment.topology import Topology
    from vllm_kimi_k3_moe.tools.selftest.harness import PreparedLayer
    from vllm_kimi_k3_moe.tools.selftest.layer import write_layer_config
    from vllm_kimi_k3_moe.tools.selftest.reference import moe_inputs
    from vllm_kimi_k3_moe.tools.selftest.shape import CPU_HIDDEN, MoeShape
    from vllm_kimi_k3_moe.tools.selftest.synthetic import expert_tensors

    text_config = {**FEW_EXPERTS, "num_experts_per_token": TOP_K}
    rows = text_config["moe_intermediate_size"]
    shape = MoeShape(WIDTH, rows, experts, TOP_K, CPU_HIDDEN)
    case = PreparationCase(config, "triton", Topology(1)).selftest_case()
    workdir = Path(tempfile.mkdtemp(prefix=f"kimi-k3-triton-{config}-"))
    write_layer_config(workdir, text_config, shape, case.config())
    fmt = checkpoint_format(config)
    tensors = expert_tensors(fmt, shape)
    inputs = moe_inputs(_expert(tensors, 0)[0], shape, torch.device("cpu"))
    return PreparedLayer(shape, fmt, workdir, tensors, inputs, torch.empty(0))


def _expert(tensors: dict[str, Any], expert: int) -> tuple[Any, Any]:
    """``expert``'s w13 ([2 x rows, width]: w1's rows, then w3's) and w2 in
    float64 from the checkpoint's tensors: FP8 values times their scales (one
    per 128 x 128 block, or one per row), BF16 as it is."""
    import torch

    from vllm_kimi_k3_moe.tools.selftest.checkpoint import expert_key

    def weight(projection: str) -> Any:
        value = tensors[expert_key(expert, projection, "weight")].double()
        scale = tensors.get(expert_key(expert, projection, "weight_scale"))
        if scale is None:
            return value
        scale = scale.double()
        if tuple(scale.shape) != (value.shape[0], 1):  # not one per row: blocks
            scale = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            scale = scale[: value.shape[0], : value.shape[1]]
        return value * scale

    return torch.cat([weight("w1"), weight("w3")]), weight("w2")


def as_fp8_activations(values: Any, group: int | None) -> Any:
    """``values`` ([tokens, columns], float64) as the kernel's FP8 inputs
    carry them, back in float64: each token's groups of ``group`` columns
    scaled by their largest magnitude over ``FP8_MAX``, rounded to
    float8_e4m3fn, scaled back. Unchanged where ``group`` is None."""
    import torch

    if group is None or values.numel() == 0:
        return values
    single = values.float()  # the kernel's activations are FP32
    rounded = []
    for part in single.split(min(group, single.shape[-1]), dim=-1):
        scale = part.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
        fp8 = (part / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        rounded.append(fp8.double() * scale.double())
    return torch.cat(rounded, dim=-1)


def share(
    layer: Any, start: int, end: int, experts: list[int], group: int | None
) -> Any:
    """The unsharded experts' output from rows ``[start, end)`` of
    ``experts`` alone, float64, with Kimi-K3's routing and SiTU
    (``reference``), the GEMMs' inputs rounded to FP8 in groups of
    ``group`` columns as the GPU's kernel rounds them (the intermediate
    over the GPU's own rows: its groups start at ``start``)."""
    from vllm_kimi_k3_moe.tools.selftest.reference import reference_routing, situ

    rows = layer.shape.intermediate
    hidden = as_fp8_activations(layer.inputs.hidden[:TOKENS].double(), group)
    weights, ids = reference_routing(
        layer.inputs.logits[:TOKENS], layer.inputs.bias, layer.shape.top_k
    )
    output = hidden.new_zeros(hidden.shape)
    for expert in experts:
        token, slot = (ids == expert).nonzero(as_tuple=True)
        w13, w2 = _expert(layer.tensors, expert)
        gate = hidden[token] @ w13[start:end].T
        up = hidden[token] @ w13[rows + start : rows + end].T
        intermediate = as_fp8_activations(situ(gate, up), group)
        contribution = intermediate @ w2[:, start:end].T
        output.index_add_(0, token, contribution * weights[token, slot, None])
    return output


def run_case(kimi_model: Any, case: dict[str, Any]) -> dict[str, Any]:
    """One GPU: its output against its share; what ran."""
    import torch

    from tests.models.kimi_k3.builders import NAN_BYTE
    from tests.models.kimi_k3.gpu_stand_ins import uninitialised_memory_reads
    from tests.models.kimi_k3.preparation.harness import PreparationCase
    from vllm_kimi_k3_moe.tools.deployment.topology import Topology
    from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
    from vllm_kimi_k3_moe.tools.selftest.harness import loaded_rank
    from vllm_kimi_k3_moe.tools.selftest.interpreted_triton import InterpretedTriton
    from vllm_kimi_k3_moe.tools.selftest.reference import relative_error

    topology = Topology(**case["topology"])
    gpus = topology.moe_group
    experts = -(-EXPERTS // gpus) * gpus if topology.expert_parallel else EXPERTS
    layer = _layer(case["config"], experts)
    selftest = PreparationCase(case["config"], "triton", topology).selftest_case()
    tp, rank_index = topology.tp_size, case["rank"]
    rank = Rank(topology, tp_rank=rank_index % tp, dp_rank=rank_index // tp)
    path = InterpretedTriton()
    with loaded_rank(
        path,
        selftest,
        kimi_model,
        layer,
        rank,
        building=lambda: uninitialised_memory_reads(NAN_BYTE),
    ) as loaded:
        with loaded.kernel.context():
            output = loaded.forward(*layer.inputs.first(TOKENS)).double()
        experts_here = loaded.experts.local_num_experts
        allocated = loaded.experts.intermediate_size_per_partition
        kernel = path.kernel(loaded.experts)
        held = layer.shape.intermediate if topology.expert_parallel else None
        held = held or case["rows"][1] - case["rows"][0]
        pad = pad_weights(loaded.experts, held)
    if topology.expert_parallel:
        mine = list(range(rank_index * experts_here, (rank_index + 1) * experts_here))
        start, end = 0, layer.shape.intermediate
    else:
        mine, (start, end) = list(range(experts)), case["rows"]
    expected = share(layer, start, end, mine, ACTIVATION_GROUP[case["config"]])
    finite = bool(torch.isfinite(output).all())
    if end > start or mine != list(range(experts)):
        error = relative_error(output, expected) if finite else float("nan")
    else:  # a GPU holding no row: only zeros may come out
        error = 0.0 if finite and not output.any() else float("inf")
    return {
        "error": error,
        "finite": finite,
        "kernel": kernel,
        "allocated": allocated,
        "held": held,
        "pad_entries": pad.numel(),
        "pad_nonzero": int(pad.ne(0).sum()),  # NaN is not 0
    }


def pad_weights(experts: Any, held: int) -> Any:
    """Every weight entry the kernel reads past the ``held`` checkpoint rows
    of the ``allocated`` (``intermediate_size_per_partition``) it multiplies
    through, as prepared: w13's gate rows ``[held, allocated)`` and up rows
    ``[allocated + held, 2 x allocated)``, w2's columns ``[held,
    allocated)``, of every expert; flattened (empty where nothing is padded)."""
    import torch

    allocated = experts.intermediate_size_per_partition
    w13, w2 = experts.w13_weight, experts.w2_weight
    assert w13.shape[1] == 2 * allocated and w2.shape[2] == allocated, (
        "the kernel's weights are not [experts, 2 x rows, width] and "
        f"[experts, width, rows]: {tuple(w13.shape)}, {tuple(w2.shape)}"
    )
    return torch.cat(
        [
            w13[:, held:allocated].float().flatten(),
            w13[:, allocated + held :].float().flatten(),
            w2[:, :, held:].float().flatten(),
        ]
    )


def main() -> None:
    import torch

    import vllm_kimi_k3_moe

    torch.set_num_threads(1)
    vllm_kimi_k3_moe.register()
    kimi_model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    cases = json.load(sys.stdin)
    results = {}
    for case in cases:
        began = time.perf_counter()
        try:
            results[case["label"]] = run_case(kimi_model, case)
        except Exception as error:  # reported by the test, with its case
            results[case["label"]] = {"failure": f"{type(error).__name__}: {error}"}
        # for the budget (``--durations`` shows the whole run only)
        results[case["label"]]["seconds"] = time.perf_counter() - began
    Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
