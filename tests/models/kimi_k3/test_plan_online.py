"""``plan --quantization <online method>``: a BF16 Kimi-K3 checkpoint quantized
while vLLM loads it, sized on ``meta`` as the plugin partitions it (the
method's rule learned from what it quantizes to), its routed experts counted
as the quantized tensors the method hands its kernel; ``check`` takes the
serve line plan prints and sizes it alike; a name vLLM does not accept is
refused by name.

The independent source for the rows and bytes is the runtime's CPU path
(``preparation.online.quantize_rank``): GPU 0 of TP32 built, loaded by
vLLM's loader and quantized by the method's own
``process_weights_after_loading`` on real CPU tensors, with vLLM's
``RoutedExperts`` the plugin built. Its rows are what plan must print; its
quantized tensors' dtypes, with FP8 per block's 128 x 128 scale blocks,
give the bytes at Kimi-K3's shape.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.header_set import write as write_header_set
from tests.models.kimi_k3.preparation.online import PATHS, quantize_rank
from tests.models.kimi_k3.test_plan_to_check import node_blocks
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

TP32_FP8_BLOCK = Deployment(
    32, backend="marlin", quantization="bf16", online="fp8_per_block"
)
EXPERTS = KIMI_K3_TEXT_CONFIG["num_experts"]
WIDTH = KIMI_K3_TEXT_CONFIG["routed_expert_hidden_size"]
BLOCK = 128  # FP8 per block's scale block, rows x columns


@pytest.fixture(scope="module")
def fp8_block_plan(kimi_model):
    from vllm_kimi_k3_moe.tools.plan.planner import Planner

    with Planner(KIMI_K3_TEXT_CONFIG) as planner:
        return planner.plan(TP32_FP8_BLOCK)


@pytest.fixture(scope="module")
def runtime_gpu0(kimi_model):
    """GPU 0 of TP32 quantized by FP8 per block on the CPU, as at runtime."""
    (path,) = [p for p in PATHS if p.name == "fp8_per_block"]
    quantized = quantize_rank(kimi_model, path, "marlin", Rank(Topology(32)))
    assert quantized.error is None, quantized.error
    return quantized


def test_plan_gives_fp8_per_block_the_runtimes_partition(
    fp8_block_plan, runtime_gpu0
) -> None:
    moe = fp8_block_plan.moe
    runtime_rows = runtime_gpu0.experts.moe_config.intermediate_size_per_partition
    assert moe.fixed.intermediate_per_rank == runtime_rows == 128
    assert moe.upstream.intermediate_per_rank == 256  # vLLM alone's


def test_plan_counts_the_quantized_experts_not_the_bf16(
    fp8_block_plan, runtime_gpu0
) -> None:
    """FP8 values, one per weight element, and one scale per 128 x 128
    block of gate, up and down: the dtypes the runtime's quantization
    produced, at Kimi-K3's experts and latent width."""
    tensors = runtime_gpu0.quantized.tensors
    value = tensors["w13"].element_size()
    scale = tensors["w13_scale"].element_size()
    assert (value, tensors["w2"].element_size()) == (1, 1)

    def expected(rows: int) -> int:
        values = 3 * rows * WIDTH * value
        blocks = 3 * (rows // BLOCK) * (WIDTH // BLOCK)
        return EXPERTS * (values + blocks * scale)

    moe = fp8_block_plan.moe
    assert moe.fixed.routed_bytes == expected(128)
    assert moe.upstream.routed_bytes == expected(256)
    bf16 = EXPERTS * 3 * 128 * WIDTH * 2  # what create_weights allocates
    assert moe.fixed.routed_bytes < bf16


def printed(capsys, *args: str) -> tuple[str, str]:
    status = main(list(args))
    out = capsys.readouterr()
    assert status == 0, out.err
    return out.out, out.err


def test_plans_serve_line_for_an_online_method_passes_check(
    kimi_model, tmp_path: Path, capsys
) -> None:
    """plan prints ``--quantization fp8_per_block`` in its serve line; check
    on that line, as printed, over a BF16 checkpoint's headers, agrees on
    the rows and the routed-expert memory."""
    write_header_set(tmp_path, "bf16")
    out, err = printed(
        capsys,
        *("plan", "--quantization", "fp8_per_block", "--gpu", "b300"),
        *("--tp", "32", "--model", str(tmp_path), "--wide"),
    )
    assert "BF16, --quantization fp8_per_block" in out
    assert "routed experts counted as the quantized tensors" in err
    head = node_blocks(out)["node 0"]
    assert "--quantization fp8_per_block" in head
    checked, _ = printed(capsys, "check", "--serve-command", head)
    assert checked.splitlines()[-1].startswith("OK "), checked
    allocated = next(line for line in checked.splitlines() if "allocated" in line)
    assert "128 intermediate rows per expert with this plugin (upstream 256)" in (
        allocated
    )
    gb = float(re.search(r"routed experts ([\d.]+) GB", allocated).group(1))
    per_layer = 128 * 3 * WIDTH + 3 * (WIDTH // BLOCK) * 4  # FP8, FP32 scales
    assert gb == pytest.approx(EXPERTS * per_layer * 92 / 1e9, abs=0.01)


def test_an_unknown_method_is_refused_by_name(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--quantization", "fp9_per_block"])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "'fp9_per_block'" in error
    assert "fp8_per_block" in error and "mxfp4" in error


def test_plan_sizes_a_method_that_quantizes_the_linear_layers_too(kimi_model):
    """FP8 per channel quantizes the linear layers as well: plan builds them
    with vLLM's own linear-kernel choice (per-token FP8, as on the GPU),
    and gives the routed experts the runtime's rows."""
    from vllm_kimi_k3_moe.tools.plan.planner import Planner

    (path,) = [p for p in PATHS if p.name == "fp8_per_channel"]
    runtime = quantize_rank(kimi_model, path, "triton", Rank(Topology(32)))
    assert runtime.error is None, runtime.error
    deployment = Deployment(
        32, backend="triton", quantization="bf16", online="fp8_per_channel"
    )
    with Planner(KIMI_K3_TEXT_CONFIG) as planner:
        moe = planner.plan(deployment).moe
    runtime_rows = runtime.experts.moe_config.intermediate_size_per_partition
    assert moe.fixed.intermediate_per_rank == runtime_rows == 96
    assert moe.upstream.intermediate_per_rank == 256
