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
process). With the plugin, on the kernel vLLM alone's is, with the rows vLLM
alone allocates:

- the layer records the rows the GPU holds (3072 over TP x DP);
- the BF16 the method quantizes is the rows loaded, and zero past them;
- what it quantized dequantizes to that BF16 within the format's error, and
  its pads to zero;
- where vLLM alone is right too, the prepared layer is vLLM alone's, bit for
  bit; where vLLM refuses to prepare it, it refuses the same way.
"""

from __future__ import annotations

import logging
import typing

import pytest
import torch

from tests.models.kimi_k3.preparation.online import (
    ALIASES,
    COMPOSED,
    LAYOUTS,
    PATHS,
    OnlinePath,
    QuantizedRank,
    gpu_of,
    kernel,
    kernel_names,
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
    if allocated != alone.intermediate_size_per_partition:
        found.append(
            f"{allocated} rows, vLLM alone {alone.intermediate_size_per_partition}"
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
    if not what_is_wrong(theirs):
        found += _same_layer(mine, theirs)
    return found


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


@pytest.mark.parametrize("path", PATHS[:1], ids=OnlinePath.label)
def test_no_rule_is_learned_from_an_online_methods_bf16(kimi_model, path):
    """An online method's ``create_weights`` allocates the BF16 it loads: one
    element per row, a learned group of 1, whatever its format's blocks.
    vLLM's online loaders refuse the learned rule's scratch module (it gives
    no weight loader); with them out of the way, the method's BF16 is
    allocated there, and still no rule is learned from it."""
    from vllm.model_executor.layers.quantization.online import moe_base

    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import learned_rule
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe.partition import rule_of
    from vllm_kimi_k3_moe.patching import replaced_attributes
    from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank

    topology = Topology(32)
    experts = build_alone(kimi_model, path, path.backends[0], topology)
    method, config = experts.quant_method, experts.moe_config
    with (
        simulated_rank(Rank(topology)),
        replaced_attributes(moe_base, initialize_online_processing=lambda layer: None),
    ):
        bf16 = learned_rule._expert_tensors(method, config, 3072)
        assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
        assert rule_of(method, config) is None


@pytest.mark.parametrize(
    ("topology", "expected"),
    [
        (
            Topology(16),
            [
                "Kimi-K3 routed experts on Fp8PerTensorOnlineMoEMethod (triton): 256 "
                "intermediate rows per GPU (logical 192, vLLM alone 256); quantized "
                "while loading (online): vLLM alone's partition",
                "Kimi-K3 routed experts on Fp8PerTensorOnlineMoEMethod (triton): "
                "zeroed pad rows 192-255 of every expert (gate, up and down) once "
                "loaded, before the method quantized them",
            ],
        ),
        (  # no pad: nothing zeroed, nothing said of it
            Topology(8),
            [
                "Kimi-K3 routed experts on Fp8PerTensorOnlineMoEMethod (triton): 384 "
                "intermediate rows per GPU (logical 384, vLLM alone 384); quantized "
                "while loading (online): vLLM alone's partition",
            ],
        ),
    ],
    ids=lambda v: v.label() if isinstance(v, Topology) else "",
)
def test_the_log_says_what_happened_when_it_happened(
    kimi_model, caplog, monkeypatch, topology, expected
):
    """The construction line claims no zeroing (the weights are on ``meta``
    then); the zeroing is said once it is done, after loading."""
    from vllm_kimi_k3_moe.model_executor.layers.fused_moe import routed_experts

    monkeypatch.setattr(routed_experts, "_logged", set())
    monkeypatch.setattr(routed_experts.logger, "handlers", [caplog.handler])
    monkeypatch.setattr(routed_experts.logger, "propagate", False)
    caplog.set_level(logging.INFO, logger=routed_experts.logger.name)
    (path,) = [p for p in PATHS if p.name == "fp8_per_tensor"]
    quantize_rank(kimi_model, path, "triton", Rank(topology))
    lines = [
        r.getMessage() for r in caplog.records if r.name == routed_experts.logger.name
    ]
    assert lines == [f"vllm-kimi-k3-moe: {line}" for line in expected]
