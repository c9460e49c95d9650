"""``check`` recognises every published Kimi-K3 format from its config, as vLLM
will load it, and finds each kind of problem in each format's expert tensors."""

from __future__ import annotations

import json

import pytest

from tests.models.kimi_k3.format_checkpoints import (
    FORMAT_TENSORS,
    write_format_checkpoint,
)
from tests.models.kimi_k3.kimi_k3_checkpoint import (
    QUANTIZATION_CONFIG as RELEASED_MXFP4,
)
from tests.models.kimi_k3.kimi_k3_checkpoint import KimiK3Spec, expert_tensor_name
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import FormatError, recognise
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.topology import Topology

SPEC = KimiK3Spec()
FORMATS = list(FORMAT_TENSORS)


def check(capsys, *args: str) -> tuple[int, str]:
    status = main(["check", *args])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_clean_checkpoint_of_each_format_passes(tmp_path, capsys, fmt):
    written = write_format_checkpoint(tmp_path, fmt)
    status, out = check(capsys, str(tmp_path), "--tp", "32")
    assert status == 0, out
    assert f"{written} expected, {written} found and checked" in out
    suffixes = ", ".join(suffix for suffix, _, _ in FORMAT_TENSORS[fmt])
    assert f"(w1, w3, w2 x {suffixes})" in out


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_problem_is_named_in_each_format(tmp_path, capsys, fmt):
    sharded, _, dtype = FORMAT_TENSORS[fmt][0]
    last_suffix = FORMAT_TENSORS[fmt][-1][0]
    reshaped = expert_tensor_name(1, 2, "w1", sharded)
    retyped = expert_tensor_name(2, 0, "w2", sharded)
    dropped = expert_tensor_name(3, 7, "w3", last_suffix)
    doubled = expert_tensor_name(1, 0, "w3", last_suffix)
    stray = expert_tensor_name(1, 0, "w1", "weight_zero_point")

    def corrupt(entries):
        for index, (name, entry_dtype, shape) in enumerate(entries):
            if name == reshaped:
                entries[index] = (name, entry_dtype, (shape[0] // 2, *shape[1:]))
            elif name == retyped:
                entries[index] = (name, "F32" if dtype != "F32" else "BF16", shape)
        entries[:] = [entry for entry in entries if entry[0] != dropped]
        # the last shard gets a second copy of a first-shard tensor
        entries += [next(e for e in entries if e[0] == doubled), (stray, "I32", (1,))]

    write_format_checkpoint(tmp_path, fmt, edit=corrupt)
    status, out = check(capsys, str(tmp_path))
    assert status == 1
    assert f"  shape: {reshaped}: is [" in out
    assert f"  dtype: {retyped}: is " in out and f"expected {dtype}" in out
    assert f"  missing: {dropped}: expected " in out
    assert f"  duplicate: {doubled}: in model-00001-of-00003.safetensors and " in out
    assert f"  unexpected: {stray}: " in out
    kinds = "1 missing, 1 shape, 1 dtype, 1 duplicate, 1 unexpected"
    assert f"\nproblems    5: {kinds}\n" in out


@pytest.mark.parametrize("fmt", ["mxfp4", "ct-mxfp4", *FORMATS])
def test_check_names_the_method_vllm_builds(format_experts, fmt):
    """The format check recognises is the one vLLM 0.33.0 builds: the same
    quantization method for the routed experts."""
    backend = {"fp8-block": "triton", "bf16": "triton"}.get(fmt, "marlin")
    if "nvfp4" in fmt:
        backend = "flashinfer_cutedsl"
    experts = format_experts(fmt, backend, Topology(32))
    # native MXFP4 is what vLLM rewrites the released config to
    config = RELEASED_MXFP4 if fmt == "mxfp4" else QUANTIZATION_CONFIGS[fmt]
    recognised = recognise(config, None, "config.json")
    assert type(experts.quant_method).__name__ in recognised.loads_as


MODELOPT_HF_QUANT_CONFIG = {
    "quant_algo": "NVFP4",
    "group_size": 16,
    "exclude_modules": QUANTIZATION_CONFIGS["modelopt-nvfp4"]["ignore"],
}


def test_modelopt_hf_quant_config_is_read(tmp_path, capsys):
    write_format_checkpoint(tmp_path, "modelopt-nvfp4")
    # the suite's checkpoints keep the adapters BF16: the file says so
    # (without it vLLM would quantize every linear layer, adapters included)
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": MODELOPT_HF_QUANT_CONFIG})
    )
    status, out = check(capsys, str(tmp_path))
    assert status == 0, out
    assert "format      ModelOpt NVFP4; vLLM loads its experts with " in out


def test_moe_backend_sizes_every_format_as_plan_does(kimi_model, tmp_path, capsys):
    """check --moe-backend builds the checkpoint's language model through
    plan's path, whatever the format."""
    write_format_checkpoint(tmp_path, "fp8-block")
    status, out = check(capsys, str(tmp_path), "--moe-backend", "triton")
    assert status == 0, out
    assert f"allocated   on triton, by {VLLM}'s own layer: 128 intermediate" in out


def test_moe_backend_not_of_the_format_is_refused(tmp_path, capsys):
    write_format_checkpoint(tmp_path, "fp8-block")
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(tmp_path), "--moe-backend", "cutlass"])
    assert exit_info.value.code == 2
    assert "'cutlass' for fp8-block" in capsys.readouterr().err


def test_an_unknown_format_lists_the_known_ones():
    with pytest.raises(FormatError) as raised:
        recognise({"quant_method": "awq"}, None, "config.json")
    message = str(raised.value)
    assert "quant_method 'awq'" in message
    assert "compressed-tensors FP8 block" in message and "ModelOpt NVFP4" in message


# FP8 block [128, 128] at hidden 256: per expert w1, w3, w2 of 3072 x 256
# one-byte values and 24 x 2 BF16 block scales; 3 MoE layers x 8 experts.
FP8_EXPERT_BYTES = 3 * 8 * 3 * (3072 * 256 + 24 * 2 * 2)
BLOCKS = "all 8 experts, whole 128-row FP8 blocks of each:"


def fp8_share(rows: int, each: bool = True) -> str:
    """What GPUs holding ``rows`` rows of every expert load, as check says it."""
    share = FP8_EXPERT_BYTES * rows // 3072
    return f"{share / 1e6:.2f} MB of routed-expert checkpoint data" + (
        " each" if each else ""
    )


# What check says each GPU loads of FP8 block experts: whole blocks where an
# even slice would split them (as test_format_checkpoints_end_to_end loads
# them through vLLM, from the same record: CheckpointFormat.rank_rows).
FP8_PER_GPU = {
    "TP32": (
        ["--tp", "32"],
        [
            f"per GPU     TP32 without expert parallelism: {BLOCKS}",
            "            GPUs 0-23: 128 of 3072 intermediate rows each (GPU r: rows "
            f"128r to 128r+127); {fp8_share(128)}",
            "            GPUs 24-31: none of the experts' rows",
        ],
    ),
    "TP16": (
        ["--tp", "16"],
        [
            f"per GPU     TP16 without expert parallelism: {BLOCKS}",
            "            GPUs 0-11: 256 of 3072 intermediate rows each (GPU r: rows "
            f"256r to 256r+255); {fp8_share(256)}",
            "            GPUs 12-15: none of the experts' rows",
        ],
    ),
    "TP16 DP2": (  # vLLM shards the experts over all 32 GPUs
        ["--tp", "16", "--dp", "2"],
        [
            f"per GPU     TP16 x DP2 without expert parallelism: {BLOCKS}",
            "            GPUs 0-23: 128 of 3072 intermediate rows each (GPU r: rows "
            f"128r to 128r+127); {fp8_share(128)}",
            "            GPUs 24-31: none of the experts' rows",
        ],
    ),
    "TP8": (  # 384 rows: three whole blocks, the even slice
        ["--tp", "8"],
        [
            "per GPU     TP8 without expert parallelism: all 8 experts, 384 of 3072 "
            "intermediate rows each (GPU r: rows 384r to 384r+383); "
            f"{fp8_share(384, each=False)}"
        ],
    ),
}


@pytest.mark.parametrize("topology", FP8_PER_GPU)
def test_fp8_block_per_gpu_lines_say_which_gpus_hold_which_rows(
    tmp_path, capsys, topology
):
    write_format_checkpoint(tmp_path, "fp8-block")
    args, expected = FP8_PER_GPU[topology]
    status, out = check(capsys, str(tmp_path), *args)
    assert status == 0, out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("per GPU"))
    assert lines[first : first + len(expected)] == expected
    assert lines[first + len(expected)].startswith("OK ")


# INT groups of 128 (AWQ, GPTQ) split as FP8's blocks, also where the experts
# are split through data parallelism (TP8 x DP4: all 32 GPUs, no model-level
# padding in vLLM alone)
INT_GROUPS_PER_GPU = [
    "per GPU     TP8 x DP4 without expert parallelism: all 8 experts, whole "
    "128-row INT scale groups of each:",
    "            GPUs 0-23: 128 of 3072 intermediate rows each (GPU r: rows "
    "128r to 128r+127); ",
    "            GPUs 24-31: none of the experts' rows",
]


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int_groups_of_128_per_gpu_lines_say_which_gpus_hold_which_rows(
    tmp_path, capsys, fmt
):
    write_format_checkpoint(tmp_path, fmt)
    status, out = check(capsys, str(tmp_path), "--tp", "8", "--dp", "4")
    assert status == 0, out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("per GPU"))
    held = lines[first : first + len(INT_GROUPS_PER_GPU)]
    pairs = zip(held, INT_GROUPS_PER_GPU, strict=True)
    assert [line[: len(want)] for line, want in pairs] == (INT_GROUPS_PER_GPU)


@pytest.mark.parametrize(
    "fmt", [f for f in FORMATS if f not in ("fp8-block", "awq", "gptq")]
)
def test_other_formats_per_gpu_line_is_the_even_slice(tmp_path, capsys, fmt):
    write_format_checkpoint(tmp_path, fmt)
    status, out = check(capsys, str(tmp_path), "--tp", "32")
    assert status == 0, out
    assert (
        "per GPU     TP32 without expert parallelism: all 8 experts, 96 of 3072 "
        "intermediate rows each (GPU r: rows 96r to 96r+95); "
    ) in out


def test_whole_blocks_a_kernel_may_widen_are_said_to_depend_on_it(tmp_path, capsys):
    """NVFP4 over 256 GPUs (TP8 x DP32): 12 rows would split the 16-value
    scale groups, so the first GPUs hold whole groups; how many rows each
    holds is the kernel's partition (CUTLASS allocates 64), which check says
    depends on it."""
    write_format_checkpoint(tmp_path, "nvfp4")
    status, out = check(capsys, str(tmp_path), "--tp", "8", "--dp", "32")
    assert status == 0, out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("per GPU"))
    assert lines[first] == (
        "per GPU     TP8 x DP32 without expert parallelism: all 8 experts, whole "
        "16-row NVFP4 scale groups of each:"
    )
    assert lines[first + 1].startswith(
        "            GPUs 0-191: 16 of 3072 intermediate rows each"
    )
    assert lines[first + 2] == "            GPUs 192-255: none of the experts' rows"
    assert "gives each GPU that many: --moe-backend NAME)" in lines[first + 4]
