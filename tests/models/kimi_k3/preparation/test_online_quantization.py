"""Online quantization is never worse than vLLM alone, and right: a BF16
Kimi-K3 checkpoint served with ``--quantization fp8_per_block``, ``mxfp4``,
``fp8_per_tensor``, ``fp8_per_channel``, ``mxfp8``,
``int8_per_channel_weight_only``, ``nvfp4_per_token`` (``lut_b_moe`` on
vLLM 0.34), or ``--quantization-config '{"moe": ...}'`` over a checkpoint
that leaves its experts unquantized, on every kernel vLLM alone builds each
on, at TP8, TP16, TP32, TP16 x DP2, TP8 x DP4 and TP4 x DP8 (GPU 0; and the
last GPU, whose slice is the checkpoint's last rows, on the first kernel).

Each GPU is built, loaded by vLLM's loader, quantized by the method's own
``process_weights_after_loading`` and prepared by its kernel on the CPU
(``online``), with every allocation vLLM leaves unwritten reading 0x7F bytes
(3.4e38): with the plugin and with vLLM alone (the plugin taken out of the
process). With the plugin, on the kernel vLLM alone's is:

- the rows the method's quantization and its kernel keep (``SMALLEST``, at
  TP32: whole blocks of its format, its kernel's tiles), no more than vLLM
  alone allocates, or, where more, a prepared layer that is vLLM alone's bit
  for bit (its kernel pads vLLM alone's partition to the same);
- the layer records the rows the GPU holds (3072 over TP x DP);
- the BF16 the method quantizes is the rows loaded, and zero past them;
- what it quantized dequantizes to that BF16 within the format's error, and
  its pads to zero;
- where vLLM alone is right too and allocates as many rows, the prepared
  layer is vLLM alone's, bit for bit; where vLLM refuses to prepare it, it
  refuses the same way.
"""

from __future__ import annotations

import logging
import typing

import pytest
import torch

from tests.models.kimi_k3.gpu_stand_ins import a_cuda_node
from tests.models.kimi_k3.preparation.online import (
    ALIASES,
    COMPOSED,
    LAYOUTS,
    PATHS,
    OnlinePath,
    Quantized,
    QuantizedRank,
    bf16_layer,
    gpu_of,
    kernel,
    kernel_names,
    online_methods_observed,
    quantize_rank,
    refusal,
    what_is_wrong,
)
from tests.models.kimi_k3.preparation.online_builds import (
    build_alone,
    experts_method_of_flags,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank


def last_gpu(topology: Topology) -> Rank:
    return Rank(topology, tp_rank=topology.tp_size - 1, dp_rank=topology.dp_size - 1)


def bf16_problems(mine: QuantizedRank) -> list[str]:
    """The BF16 the method quantized: the rows loaded, zero past them."""
    w13, w2 = mine.quantized.bf16["w13"], mine.quantized.bf16["w2"]
    loaded_w13, loaded_w2 = mine.loaded
    held, allocated = loaded_w2.shape[-1], w2.shape[-1]
    found = []
    for name, got, want in (
        ("gate", w13[:, :held], loaded_w13[:, :held]),
        ("up", w13[:, allocated : allocated + held], loaded_w13[:, held:]),
        ("down", w2[..., :held], loaded_w2),
    ):
        if not torch.equal(got, want):
            found.append(f"{name}: the rows quantized are not the rows loaded")
    for name, pad in (
        ("gate", w13[:, held:allocated]),
        ("up", w13[:, allocated + held :]),
        ("down", w2[..., held:]),
    ):
        if pad.numel() and bool(pad.any()):
            found.append(f"{name}: pad rows {held}-{allocated - 1} not zero")
    return found


def _same_layer(mine: QuantizedRank, theirs: QuantizedRank) -> list[str]:
    """Every prepared parameter of ``mine`` is ``theirs``, bit for bit."""
    ours = dict(mine.experts.named_parameters())
    alone = dict(theirs.experts.named_parameters())
    if ours.keys() != alone.keys():
        return [f"other parameters: {sorted(ours)} vs {sorted(alone)}"]
    return [
        f"{name} differs from vLLM alone's"
        for name, tensor in ours.items()
        if tensor.shape != alone[name].shape
        or tensor.dtype != alone[name].dtype
        or not torch.equal(tensor.view(torch.uint8), alone[name].view(torch.uint8))
    ]


def problems(mine: QuantizedRank, theirs: QuantizedRank, rows: int) -> list[str]:
    """Where the plugin's GPU (``mine``) is worse than vLLM alone's
    (``theirs``), or wrong; ``rows``: what the GPU holds."""
    found = bf16_problems(mine) if mine.quantized.bf16 else []
    if theirs.error is not None:  # vLLM alone refuses: the plugin the same way
        if mine.error is None or refusal(mine) != refusal(theirs):
            found.append(f"vLLM alone refuses ({refusal(theirs)}), the plugin not so")
        if mine.quantized.tensors:  # it quantized before its kernel refused
            found += what_is_wrong(mine)
        return found
    if mine.error is not None:
        return [*found, f"vLLM alone prepares it, the plugin: {refusal(mine)}"]
    found += what_is_wrong(mine)
    if kernel(mine) != kernel(theirs):
        found.append(f"kernel {kernel(mine)}, vLLM alone's {kernel(theirs)}")
    config, alone = mine.experts.moe_config, theirs.experts.moe_config
    allocated = config.intermediate_size_per_partition
    theirs_allocated = alone.intermediate_size_per_partition
    same = [] if what_is_wrong(theirs) else _same_layer(mine, theirs)
    if allocated == theirs_allocated:
        found += same
    elif allocated > theirs_allocated and (what_is_wrong(theirs) or same):
        found.append(
            f"{allocated} rows, vLLM alone {theirs_allocated}, and its kernel "
            "does not keep as many"
        )
    if config.intermediate_size_per_partition_unpadded != rows:
        found.append(
            f"records {config.intermediate_size_per_partition_unpadded} rows held"
        )
    # vLLM 0.34's direct-mode reload zero-fills what the layer loaded with
    # pads (a kernel may pad again when it prepares: its own zeros)
    filled, loaded = mine.quantized.padding_fill, mine.quantized.bf16["w2"]
    if loaded.shape[-1] > rows and filled is not None and "w13_weight" not in filled:
        found.append("a direct-mode reload would leave its pads as memory held")
    return found


# The rows GPU 0 of TP32 (96 of each expert's 3072) allocates with the
# plugin, by path and kernel (vLLM alone: 256), as each format and kernel
# dictates: FP8 in 128-row blocks (per block: the method's own rounding);
# Marlin's 64-row thread tiles (``marlin_moe_padded_intermediate``); Humming
# pads the rows to 128; NVFP4's gated FlashInfer kernels each of gate and up
# to 64; per-tensor and per-channel FP8, MXFP8 (blocks of 32) and MXFP4 on
# b12x take 96 as it is; CUTLASS FP8 reads 16 FP8 values at a time. LUT-B
# keeps vLLM alone's (its quantization is not learned: no ``_setup_kernel``).
SMALLEST = {
    ("fp8_per_block", "triton"): 128,
    ("fp8_per_block", "marlin"): 128,
    ("fp8_per_block", "humming"): 128,
    ("mxfp4", "marlin"): 128,
    ("mxfp4", "humming"): 128,
    ("mxfp4", "b12x"): 96,
    ("fp8_per_tensor", "triton"): 96,
    ("fp8_per_tensor", "marlin"): 128,
    ("fp8_per_channel", "triton"): 96,
    ("fp8_per_channel", "cutlass"): 96,
    ("fp8_per_channel", "humming"): 128,
    ("mxfp8", "marlin"): 128,
    ("mxfp8", "triton"): 96,
    ("mxfp8", "humming"): 128,
    ("int8_per_channel_weight_only", "humming"): 128,
    ("nvfp4_per_token", "flashinfer_trtllm"): 128,
    ("nvfp4_per_token", "flashinfer_cutedsl"): 128,
    ("nvfp4_per_token", "marlin"): 128,
    ("nvfp4_per_token", "humming"): 128,  # vLLM 0.33 (0.34 refuses it)
    ("lut_b_moe", "emulation"): 256,
}


def smallest_problems(mine: QuantizedRank) -> list[str]:
    """Where GPU 0 of TP32 allocates other than ``SMALLEST`` says."""
    if mine.experts is None:
        return []
    allocated = mine.experts.moe_config.intermediate_size_per_partition
    expected = SMALLEST[(mine.path.name, mine.backend)]
    return [] if allocated == expected else [f"{allocated} rows, not {expected}"]


@pytest.mark.parametrize("path", PATHS + COMPOSED, ids=OnlinePath.label)
def test_online_quantization_never_worse_and_right(kimi_model, one_cpu_thread, path):
    found = []
    for backend in path.backends:
        for topology, rows in LAYOUTS:
            gpus = [Rank(topology)]
            if backend == path.backends[0]:
                gpus.append(last_gpu(topology))
            for rank in gpus:
                mine = quantize_rank(kimi_model, path, backend, rank)
                theirs = quantize_rank(kimi_model, path, backend, rank, alone=True)
                where = f"{backend} at {topology.label()} GPU {gpu_of(rank)[0]}"
                found += [f"{where}: {p}" for p in problems(mine, theirs, rows)]
                if topology == Topology(32) and gpu_of(rank)[0] == 0:
                    found += [f"{where}: {p}" for p in smallest_problems(mine)]
    assert not found, "\n".join(found)


# Not NVIDIA kernels (ROCm's AITER, FlyDSL, RDNA3), or not built without
# expert parallelism (MegaMoE): the plugin leaves those as vLLM has them.
NOT_HERE = {
    "auto",
    "aiter",
    "aiter_mega_moe",
    "aiter_triton_mxfp4_bf16",
    "aiter_triton_mxfp4_mxfp4",
    "flydsl",
    "rdna3",
    "deep_gemm_mega_moe",
    "flashinfer_moe_ep_mega_deep_gemm",
}


@pytest.mark.parametrize("path", PATHS, ids=OnlinePath.label)
def test_the_kernels_are_every_one_vllm_alone_builds(kimi_model, path):
    """``PATHS`` names one ``--moe-backend`` for each kernel vLLM alone builds
    the method on, of every ``--moe-backend`` vLLM takes (TP1, meta)."""
    from vllm.config.kernel import MoEBackend

    built = {}
    for backend in typing.get_args(MoEBackend):
        if backend in NOT_HERE:
            continue
        experts = build_alone(kimi_model, path, backend, Topology(1))
        if experts is not None:
            names = kernel_names(experts.quant_method)
            assert names[0] == path.method, backend
            built.setdefault(names, backend)
    assert sorted(built.values()) == sorted(path.backends)


@pytest.mark.parametrize("name", [p.name for p in PATHS] + sorted(ALIASES), ids=str)
def test_each_flag_gives_the_experts_the_method_tested(kimi_model, name):
    """``--quantization NAME`` (and the older spellings ``fp8`` and
    ``experts_int8``) gives the routed experts the method the tests build
    with ``--quantization-config '{"moe": NAME}'``, as vLLM resolves the
    flags into its quantization config."""
    tested = ALIASES.get(name, name)
    (path,) = [p for p in PATHS if p.name == tested]
    assert experts_method_of_flags(kimi_model, name, None, path) == path.method
    assert experts_method_of_flags(kimi_model, "online", tested, path) == path.method


# The rows one scale (or packed element) of each method's quantized experts
# spans along the rows, as its format defines it: FP8 blocks of 128 x 128;
# MXFP4 and MXFP8 blocks of 32 along the down projection's rows; NVFP4's of
# 16; a scale per tensor, or per row of the other axis, spans none.
GROUPS = {
    "fp8_per_block": 128,
    "mxfp4": 32,
    "fp8_per_tensor": 1,
    "fp8_per_channel": 1,
    "mxfp8": 32,
    "int8_per_channel_weight_only": 1,
    "nvfp4_per_token": 16,
}


@pytest.mark.parametrize("path", PATHS, ids=OnlinePath.label)
def test_the_rule_is_learned_from_what_the_method_quantizes_to(kimi_model, path):
    """An online method's ``create_weights`` allocates the BF16 it loads: one
    element per row, a group of 1, whatever its format's blocks. The rule is
    learned from what its ``process_weights_after_loading`` quantizes to
    (the CPU's quantizers stood in, as when a layer is quantized here), and
    the layer is left as vLLM built it; LUT-B hands its kernel nothing to
    learn from: no rule."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.online import moe_base

    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import learned_rule
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import rule_of
    from vllm_kimi_k3_moe.patching import replaced_attributes
    from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
    from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config

    topology = Topology(32)
    experts = build_alone(kimi_model, path, path.backends[0], topology)
    method, config = experts.quant_method, experts.moe_config
    with (
        simulated_rank(Rank(topology)),
        replaced_attributes(moe_base, initialize_online_processing=lambda layer: None),
    ):
        bf16 = learned_rule._expert_tensors(method, config, 3072)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    # as while a layer is built: vLLM's config current (the per-token FP8
    # quantizer's stand-in is vLLM's QuantFP8, a CustomOp that reads it)
    with simulated_rank(Rank(topology)), a_cuda_node(8, path.capability):
        serving = rank_vllm_config(
            bf16_layer().model_dir, topology, path.backends[0], online=path.online()
        )
        with set_current_vllm_config(serving), online_methods_observed(Quantized()):
            rule = rule_of(method, config)
    if path.name not in GROUPS:
        assert rule is None
        return
    assert rule is not None and rule.row_group(method) == GROUPS[path.name]
    assert not rule.groups_in_checkpoint
    # the layer's method left as vLLM built it: nothing quantized, no kernel
    assert experts.w13_weight.is_meta
    assert getattr(method, "moe_kernel", None) is None


@pytest.mark.parametrize(
    ("name", "topology", "expected"),
    [
        (
            "fp8_per_block",
            Topology(16),
            [
                "Kimi-K3 routed experts on Fp8PerBlockOnlineMoEMethod (triton): 256 "
                "intermediate rows per GPU (logical 192, vLLM alone 256); smallest "
                "partition accepted (learned from what Fp8PerBlockOnlineMoEMethod "
                "quantizes: 128 rows per scale group)",
                "Kimi-K3 routed experts on Fp8PerBlockOnlineMoEMethod (triton): "
                "zeroed pad rows 192-255 of every expert (gate, up and down) once "
                "loaded, before the method quantized them",
            ],
        ),
        (  # no pad: nothing zeroed, nothing said of it
            "fp8_per_tensor",
            Topology(16),
            [
                "Kimi-K3 routed experts on Fp8PerTensorOnlineMoEMethod (triton): 192 "
                "intermediate rows per GPU (logical 192, vLLM alone 256); smallest "
                "partition accepted (learned from what Fp8PerTensorOnlineMoEMethod "
                "quantizes: 1 rows per scale group)",
            ],
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_log_says_what_happened_when_it_happened(
    kimi_model, caplog, monkeypatch, name, topology, expected
):
    """The construction line claims no zeroing (the weights are on ``meta``
    then); the zeroing is said once it is done, after loading."""
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import said_once

    monkeypatch.setattr(said_once, "_said", set())
    monkeypatch.setattr(said_once.logger, "handlers", [caplog.handler])
    monkeypatch.setattr(said_once.logger, "propagate", False)
    caplog.set_level(logging.INFO, logger=said_once.logger.name)
    (path,) = [p for p in PATHS if p.name == name]
    quantize_rank(kimi_model, path, "triton", Rank(topology))
    lines = [r.getMessage() for r in caplog.records if r.name == said_once.logger.name]
    assert lines == [f"vllm-kimi-k3-moe: {line}" for line in expected]
