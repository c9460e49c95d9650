"""``vllm-kimi-k3-moe selftest`` on a CPU, as CI runs it: the release at TP32
through the command (the partition read from every built rank, vLLM alone's
next to it, no timing), FP8 blocks as JSON, a real checkpoint of which only
the first MoE layer's experts are read, the verdict "wrong" when the
plugin is taken out, and bad input refused in one line before vLLM is
imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.kimi_k3.forward_cases import CPU, SMALL
from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    checkpoint_tensors,
    expert_tensor_name,
    split_into_shards,
    write_checkpoint,
)
from tests.test_cli import REPO, run_fresh
from vllm_kimi_k3_moe.tools import cli
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.selftest.harness import (
    SelftestCase,
    deployment_outputs,
    prepare_layer,
    vllm_alone,
)
from vllm_kimi_k3_moe.tools.selftest.report import screen
from vllm_kimi_k3_moe.tools.selftest.run import run_selftest

E8M0_ONE = 127  # an MXFP4 scale byte of 2^0


def selftest(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stdout) of ``vllm-kimi-k3-moe selftest ARGV``, in
    this process (vLLM imported once for the session)."""
    status = cli.main(["selftest", *argv])
    return status, capsys.readouterr().out


def test_the_release_at_tp32_on_a_cpu(kimi_model, capsys) -> None:
    status, out = selftest(capsys, "--tp", "32")
    first, *lines = out.splitlines()
    assert status == 0, out
    assert first.startswith("selftest on CPU, no CUDA device:")
    assert first.endswith("256 wide (not 3584), untimed")
    assert not [line for line in lines if line.startswith("time")]
    assert "MarlinExperts (Mxfp4MoEMethod)" in out
    # Marlin's MXFP4 partition: 3072 / 32 = 96 rows, padded to 128
    assert "partition   GPUs 0-31: 128 rows per expert (96 loaded), 32 experts" in (
        lines
    )
    assert "vLLM alone  256 rows per expert on GPU 0" in lines
    assert lines[-1].startswith("OK ")


@pytest.fixture
def small_config(tmp_path) -> Path:
    """Kimi-K3's config.json with 4 experts, top-2."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": {**KIMI_K3_TEXT_CONFIG, **SMALL}}))
    return path


@pytest.mark.slow
@pytest.mark.triton_interpreted
def test_triton_on_a_cpu_runs_the_gpus_kernel_interpreted(small_config) -> None:
    """``--moe-backend triton`` in a process of its own (as an operator runs
    it: vLLM not imported before the command chose Triton's interpreter)
    runs vLLM's Triton kernel, interpreted, on every GPU of TP2 and the
    unsharded layer, says so, and the GPUs sum to the experts (1 and 16
    tokens: ``InterpretedTriton.batch_sizes``)."""
    command = ["selftest", "--tp", "2", "--quantization", "fp8-block"]
    command += ["--moe-backend", "triton", "--config", str(small_config)]
    result = subprocess.run(
        [sys.executable, "-m", "vllm_kimi_k3_moe", *command],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert "Triton kernel, interpreted" in lines[0], lines[0]
    kernel = next(line for line in lines if line.startswith("kernel"))
    assert "TritonExperts" in kernel and "interpreted" in kernel, kernel
    assert "at 1, 16 tokens" in result.stdout, result.stdout
    assert lines[-1].startswith("OK"), result.stdout


def test_fp8_blocks_at_tp32_as_json(kimi_model, capsys, small_config) -> None:
    status, out = selftest(
        capsys,
        *("--tp", "32", "--quantization", "fp8-block", "--moe-backend", "triton"),
        *("--config", str(small_config), "--json"),
    )
    report = json.loads(out)
    assert status == 0, out
    assert (report["status"], report["timed"], report["times_us"]) == (
        "ok",
        False,
        None,
    )
    assert report["kernel"].startswith("TritonExperts")
    # every rank allocates 128 rows; whole 128-row blocks: ranks 0-23 hold
    # one each, 24-31 none (a zero pad)
    assert [p["rows"] for p in report["partitions"]] == [128] * 32
    assert [p["rows_loaded"] for p in report["partitions"]] == [
        [128 * r, 128 * r + 128] for r in range(24)
    ] + [[3072, 3072]] * 8
    assert report["vllm_alone"] == {"rows": 256, "rows_kept": 256, "error": None}
    assert all(report["errors"][n] <= report["allowed"][n] for n in ("1", "16", "128"))


def test_an_uneven_expert_parallel_split_sums_to_the_experts(
    kimi_model, capsys, tmp_path
) -> None:
    """A pruned count (7 experts, top-2) over 2 expert-parallel GPUs: the
    selftest keeps the model's remainder (5 experts: GPU 0 holds 3, GPU 1
    2, as vLLM places them) and the GPUs still sum to the experts."""
    path = tmp_path / "config.json"
    pruned = {**SMALL, "num_experts": 7}
    path.write_text(json.dumps({"text_config": {**KIMI_K3_TEXT_CONFIG, **pruned}}))
    status, out = selftest(capsys, "--tp", "2", "--ep", "--config", str(path))
    assert status == 0, out
    assert "experts     5 of 7 (top-2)" in out
    assert "partition   GPU 0: 3072 rows per expert (whole experts), 3 experts" in out
    assert "            GPU 1: 3072 rows per expert (whole experts), 2 experts" in out


def test_only_the_first_moe_layers_experts_are_read(
    kimi_model, capsys, tmp_path
) -> None:
    """A multi-layer checkpoint in the release's format whose every shard
    but the one holding layer 1's first experts is unreadable."""
    spec = KimiK3Spec()  # 8 experts, top-2: the selftest keeps experts 0-3
    tensors = checkpoint_tensors(spec)
    for name, tensor in tensors.items():
        if name.endswith("weight_scale"):
            tensor.fill_(E8M0_ONE)  # finite products in FP32
    shards = write_checkpoint(tmp_path, spec, split_into_shards(tensors, spec.shards))
    read = {
        expert_tensor_name(1, expert, projection, suffix)
        for expert in range(4)
        for projection in ("w1", "w3", "w2")
        for suffix in ("weight_packed", "weight_scale")
    }
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (holder,) = {index["weight_map"][name] for name in read}
    for name in {index["weight_map"][name] for s in shards for name in s} - {holder}:
        (tmp_path / name).write_bytes(b"")  # safetensors cannot open it
    status, out = selftest(capsys, "--tp", "32", "--checkpoint", str(tmp_path))
    assert status == 0, out
    assert f"from layer 1 of {tmp_path}" in out
    assert "experts     4 of 8 (top-2), 3072 rows x 256 wide" in out


def test_every_kernel_runs_inside_vllms_forward_context(
    kimi_model, tmp_path, monkeypatch
) -> None:
    """The kernel of every rank runs where ``get_forward_context()`` answers,
    as in vLLM's model runner (Humming's experts read it on a GPU)."""
    from vllm.forward_context import is_forward_context_available
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        NaiveBatchedExperts,
    )

    seen = []
    apply = NaiveBatchedExperts.apply

    def spy(self, *args, **kwargs):
        seen.append(is_forward_context_available())
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(NaiveBatchedExperts, "apply", spy)
    case = SelftestCase("mxfp4", Topology(1), text_config=SMALL)
    layer = prepare_layer(case, CPU, tmp_path)
    deployment_outputs(CPU, case, kimi_model, layer)
    assert seen == [True] * 3  # one rank at 1, 16 and 128 tokens


def test_without_the_plugin_the_selftest_says_wrong(kimi_model, tmp_path) -> None:
    # vLLM alone's FP8 blocks at TP32: 256 rows per rank, 96 loaded, no
    # block scale loaded (README: relative error ~1)
    case = SelftestCase("fp8-block", Topology(32), "triton", text_config=SMALL)
    with vllm_alone(kimi_model):
        result = run_selftest(case, CPU, kimi_model, tmp_path)
    assert not result.ok
    assert {p.allocated for p in result.partitions} == {256}
    assert screen(result).splitlines()[-1].startswith("WRONG ")


@pytest.mark.parametrize(
    ("fill", "words"),
    [
        # a header-only or sparse copy: every byte reads as zero
        ({"weight_packed": 0, "weight_scale": 0}, "all-zero output"),
        # 0xFF: E8M0's NaN
        ({"weight_packed": 0x11, "weight_scale": 0xFF}, "non-finite output"),
    ],
)
def test_checkpoint_data_that_cannot_judge_a_layout_exits_2(
    kimi_model, capsys, tmp_path, fill, words
) -> None:
    """Expert data all zero, or not finite, is unusable input: every layout
    sums to it, right or wrong. Exit status 2, one line, not "WRONG"; all
    zero (a header-only or sparse copy) before vLLM is imported."""
    spec = KimiK3Spec()
    tensors = checkpoint_tensors(spec)
    for name, tensor in tensors.items():
        for suffix, byte in fill.items():
            if name.endswith(suffix):
                tensor.fill_(byte)
    write_checkpoint(tmp_path, spec, split_into_shards(tensors, spec.shards))
    with pytest.raises(SystemExit) as exited:
        cli.main(["selftest", "--tp", "32", "--checkpoint", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after any progress
    assert exited.value.code == 2
    assert err.startswith("vllm-kimi-k3-moe selftest: error: ")
    assert words in err and f"layer 1 of {tmp_path}" in err, err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tp", "24"], "does not divide Kimi-K3's vocabulary"),
        (
            ["--quantization", "fp8-block", "--moe-backend", "cutlass"],
            "unknown MoE backend 'cutlass' for fp8-block",
        ),
        (["--checkpoint", "/nonexistent"], "is not a directory"),
        (
            ["--checkpoint", ".", "--config", "config.json"],
            "give --checkpoint or --config",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["selftest", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_without_the_experts_is_refused_before_vllm(
    tmp_path, capsys
) -> None:
    spec = KimiK3Spec()
    tensors = checkpoint_tensors(spec)
    missing = expert_tensor_name(1, 2, "w3", "weight_scale")
    del tensors[missing]
    write_checkpoint(tmp_path, spec, split_into_shards(tensors, spec.shards))
    argv = ("selftest", "--tp", "32", "--checkpoint", str(tmp_path))
    status, _, imported = run_fresh(*argv)
    assert (status, imported) == (2, [])  # neither torch nor vLLM imported
    with pytest.raises(SystemExit):
        cli.main(list(argv))
    assert f"has no {missing}; run vllm-kimi-k3-moe check" in capsys.readouterr().err


def test_integer_zero_points_are_refused_before_vllm(tmp_path, capsys) -> None:
    """vLLM's dequantizers the CPU reference uses take no INT zero points:
    an asymmetric checkpoint is refused in one line, not judged wrong."""
    from tests.models.kimi_k3.format_checkpoints import write_format_checkpoint

    write_format_checkpoint(tmp_path, "ct-int4-g128-asym")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["selftest", "--tp", "32", "--checkpoint", str(tmp_path)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "no FP32 reference for compressed-tensors INT4 W4A16, groups of 128" in error
    assert len(error.splitlines()) == 1
