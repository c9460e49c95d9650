"""``vllm-kimi-k3-moe check``: the header-only preflight of a Kimi-K3 checkpoint.

Checkpoints are generated in Kimi-K3's format (``kimi_k3_checkpoint``), clean
or with one corruption, and written with safetensors' own writer; the
end-to-end test proves the generator's names are the ones vLLM's Kimi-K3
loader maps.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    checkpoint_tensors,
    expert_tensor_name,
    shard_name,
    split_into_shards,
    write_checkpoint,
    write_header_only_checkpoint,
)
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.plan.serve_command import serve_commands

SPEC = KimiK3Spec()
Shards = list[dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def clean_shards() -> Shards:
    return split_into_shards(checkpoint_tensors(SPEC), SPEC.shards)


@pytest.fixture
def write(tmp_path: Path, clean_shards: Shards) -> Callable[..., Path]:
    """Write the generated checkpoint, after ``corrupt`` edits a copy of it."""

    def write_variant(corrupt: Callable[[Shards], None] | None = None) -> Path:
        shards = [dict(shard) for shard in clean_shards]
        if corrupt is not None:
            corrupt(shards)
        write_checkpoint(tmp_path, SPEC, shards)
        return tmp_path

    return write_variant


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(["check", *args])
    return status, capsys.readouterr().out


def holding(shards: Shards, name: str) -> dict[str, torch.Tensor]:
    return next(shard for shard in shards if name in shard)


def remove(*names: str) -> Callable[[Shards], None]:
    def corrupt(shards: Shards) -> None:
        for name in names:
            del holding(shards, name)[name]

    return corrupt


def replace(name: str, tensor: torch.Tensor) -> Callable[[Shards], None]:
    def corrupt(shards: Shards) -> None:
        holding(shards, name)[name] = tensor

    return corrupt


def add(name: str, tensor: torch.Tensor) -> Callable[[Shards], None]:
    def corrupt(shards: Shards) -> None:
        shards[-1][name] = tensor

    return corrupt


def also_in_last_shard(name: str) -> Callable[[Shards], None]:
    def corrupt(shards: Shards) -> None:
        shards[-1][name] = holding(shards, name)[name].clone()

    return corrupt


def bytes_of(*shape: int) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.uint8)


EXPERT_5 = [
    expert_tensor_name(2, 5, projection, suffix)
    for projection in ("w1", "w3", "w2")
    for suffix in ("weight_packed", "weight_scale")
]
# one tensor per corruption, so that all of them can be applied at once
W2_SCALE = expert_tensor_name(1, 3, "w2", "weight_scale")
W2_SCALE_BF16 = expert_tensor_name(1, 1, "w2", "weight_scale")
GATE = expert_tensor_name(1, 0, "w1", "weight_packed")
GATE_SWAPPED = expert_tensor_name(2, 0, "w1", "weight_packed")
UP = expert_tensor_name(2, 6, "w3", "weight_packed")
DOWN = expert_tensor_name(2, 7, "w2", "weight_packed")
UP_TWICE = expert_tensor_name(1, 0, "w3", "weight_packed")  # in the first shard
MTP_SCALE = expert_tensor_name(3, 4, "w1", "weight_scale")

# (corruption, the lines check must print: each names the tensor)
CORRUPTIONS = {
    "missing expert": (
        remove(*EXPERT_5),
        [f"missing: {name}: expected" for name in EXPERT_5],
    ),
    "missing scale": (
        remove(W2_SCALE),
        [f"missing: {W2_SCALE}: expected [256, 96] U8"],
    ),
    "missing MTP-layer scale": (
        remove(MTP_SCALE),
        [f"missing: {MTP_SCALE}: expected [3072, 8] U8"],
    ),
    "truncated intermediate": (
        replace(GATE, bytes_of(3000, 128)),
        [f"shape: {GATE}: is [3000, 128], expected [3072, 128]"],
    ),
    "truncated down intermediate": (
        replace(DOWN, bytes_of(256, 1024)),
        [f"shape: {DOWN}: is [256, 1024], expected [256, 1536]"],
    ),
    "gate stored with swapped dimensions": (
        replace(GATE_SWAPPED, bytes_of(128, 3072)),
        [f"shape: {GATE_SWAPPED}: is [128, 3072], expected [3072, 128]"],
    ),
    "up stored in down's layout": (
        replace(UP, bytes_of(256, 1536)),
        [f"shape: {UP}: is [256, 1536], expected [3072, 128]"],
    ),
    "duplicate across shards": (
        also_in_last_shard(UP_TWICE),
        [
            f"duplicate: {UP_TWICE}: in {shard_name(0, 3)} and {shard_name(2, 3)}; "
            "vLLM would load it twice"
        ],
    ),
    "wrong dtype": (
        replace(W2_SCALE_BF16, torch.ones((256, 96), dtype=torch.bfloat16)),
        [f"dtype: {W2_SCALE_BF16}: is BF16, expected U8"],
    ),
    "expert beyond num_experts": (
        add(expert_tensor_name(1, 8, "w1", "weight_packed"), bytes_of(3072, 128)),
        [f"unexpected: {expert_tensor_name(1, 8, 'w1', 'weight_packed')}: looks like"],
    ),
    "tensor vLLM has no parameter for": (
        add(expert_tensor_name(1, 2, "w1", "weight_global_scale"), bytes_of(1)),
        [f"unexpected: {expert_tensor_name(1, 2, 'w1', 'weight_global_scale')}"],
    ),
}


def test_a_clean_checkpoint_passes_and_is_summarised(write, capsys) -> None:
    status, out = check(capsys, str(write()))
    assert status == 0, out
    assert (
        "format      compressed-tensors mxfp4-pack-quantized; vLLM loads its "
        "experts with native MXFP4 (Mxfp4MoEMethod)" in out
    )
    assert "3 of 3 headers read (no tensor data)" in out
    assert "2 MoE layers (1, 2) + 1 MTP (3)" in out
    assert "144 expected, 144 found and checked" in out  # 3 layers x 8 x 6
    # 8 experts x 3 layers x (2 x (3072x128 + 3072x8) + 256x1536 + 256x96) bytes
    routed = 8 * 3 * (2 * (3072 * 128 + 3072 * 8) + 256 * 1536 + 256 * 96)
    assert f"{routed / 1e6:.2f} MB of it routed experts" in out
    assert "TP32 without expert parallelism: all 8 experts, 96 of 3072 " in out
    assert "(GPU r: rows 96r to 96r+95)" in out
    assert f"{routed / 32 / 1e3:.2f} kB of routed-expert checkpoint data" in out
    assert out.rstrip().splitlines()[-1].startswith("OK ")


@pytest.mark.parametrize("variant", CORRUPTIONS)
def test_each_corruption_is_reported_by_tensor_name(variant, write, capsys) -> None:
    corrupt, expected_lines = CORRUPTIONS[variant]
    status, out = check(capsys, str(write(corrupt)), "--all")
    assert status == 1, out
    for line in expected_lines:
        assert f"\n  {line}" in out, f"{line!r} not in:\n{out}"
    assert f"\nproblems    {len(expected_lines)}: " in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED ")


def all_at_once(shards: Shards) -> None:
    for corrupt, _ in CORRUPTIONS.values():
        corrupt(shards)


def test_every_problem_is_listed_with_all(write, capsys) -> None:
    status, out = check(capsys, str(write(all_at_once)), "--all")
    assert status == 1
    expected = [line for _, lines in CORRUPTIONS.values() for line in lines]
    for line in expected:
        assert f"\n  {line}" in out, line
    assert f"\nproblems    {len(expected)}: " in out
    assert "more" not in out


# What CORRUPTIONS amount to, per kind (the missing expert is 6 tensors)
KIND_COUNTS = "8 missing, 4 shape, 1 dtype, 1 duplicate, 2 unexpected"


def test_problems_are_counted_per_kind_and_shard_then_a_few_of_each(
    write, capsys
) -> None:
    status, out = check(capsys, str(write(all_at_once)))
    assert status == 1
    lines = out.splitlines()
    assert f"problems    16: {KIND_COUNTS}" in lines
    # removed tensors are in no shard (nor the index); the rest where they are
    first = lines.index("by shard    in no shard: 8 missing")
    assert lines[first + 1 : first + 4] == [  # most problems first
        f"            {shard_name(0, 3)}: 2 shape, 1 dtype",
        f"            {shard_name(2, 3)}: 1 duplicate, 2 unexpected",
        f"            {shard_name(1, 3)}: 2 shape",
    ]
    missing = [line for line in lines if line.startswith("  missing: ")]
    assert len(missing) == 3  # then how many more
    assert "  ... and 5 more missing problems (--all lists every one)" in lines
    shape = [line for line in lines if line.startswith("  shape: ")]
    assert len(shape) == 4  # all 4: a fourth costs no more than "and 1 more"


def test_a_truncated_shard_is_reported(write, capsys) -> None:
    directory = write()
    shard = directory / shard_name(1, 3)
    size = shard.stat().st_size
    with shard.open("r+b") as file:
        file.truncate(size - 1000)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    held = list(index["weight_map"].values()).count(shard.name)
    status, out = check(capsys, str(directory))
    assert status == 1
    assert (
        f"shard: {shard.name}: is {size - 1000} bytes, its header describes {size}"
        f" (truncated or incomplete download); its header lists {held} tensors" in out
    )


def test_a_shard_missing_from_disk_is_one_line_with_what_it_held(write, capsys) -> None:
    directory = write()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    lost = [n for n, s in index["weight_map"].items() if s == shard_name(2, 3)]
    lost_experts = [name for name in lost if ".experts." in name]
    layers = sorted({int(name.split(".")[2]) for name in lost_experts})
    assert lost_experts and layers == [3]  # the MTP layer's experts
    (directory / shard_name(2, 3)).unlink()
    status, out = check(capsys, str(directory))
    assert status == 1
    assert "2 of 3 headers read" in out
    assert f"144 expected, {144 - len(lost_experts)} found" in out
    assert "\nproblems    1: 1 shard\n" in out
    assert (
        f"\n  shard: {shard_name(2, 3)}: is named in the index but missing; the "
        f"index puts {len(lost_experts)} routed-expert tensors in it (layer 3)\n"
    ) in out
    assert "missing: " not in out  # its tensors are that one problem


# A config.json of Kimi-K3's published dimensions (96 heads, vocabulary 163840)
RELEASED = KimiK3Spec.released()


@pytest.mark.parametrize(
    ("fmt", "args", "rule"),
    [
        (
            "mxfp4",
            ["--tp", "8", "--dcp", "16"],
            "decode-context-parallel size 16 does not divide tensor-parallel size 8",
        ),
        ("mxfp4", ["--tp", "8", "--pp", "94"], "exceeds the 93 layers"),
        ("mxfp4", ["--tp", "8", "--pcp", "2"], "MultiHeadLatentAttention does not"),
        (
            "mxfp4",
            ["--tp", "24"],
            "TP 24 does not divide Kimi-K3's vocabulary of 163840",
        ),
        (
            "mxfp4",
            ["--tp", "5"],
            "num_attention_heads 96 does not split evenly over tensor-parallel size 5",
        ),
        (
            "mxfp4",
            ["--tp", "32", "--dp", "5"],
            "moe_intermediate_size 3072 does not split evenly over 160 GPUs "
            "(TP 32 x DP 5)",
        ),
    ],
)
def test_check_refuses_a_topology_as_plan_does_before_reading_shards(
    fmt, args, rule, tmp_path, capsys
) -> None:
    """One validation, one line, exit 2. The directory holds config.json
    only: had check gone on to the shards, it would say there are none."""
    config = RELEASED.config()
    if fmt != "mxfp4":  # the released config's is MXFP4's
        config["quantization_config"] = QUANTIZATION_CONFIGS[fmt]
    (tmp_path / "config.json").write_text(json.dumps(config))
    refusals = []
    for command in (
        ["plan", "--config", str(tmp_path / "config.json"), "--quantization", fmt],
        ["check", str(tmp_path)],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, *args])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        refusals.append(captured.err)
    plan_refusal, check_refusal = refusals
    assert check_refusal == plan_refusal.replace(" plan: ", " check: ", 1)
    assert check_refusal.startswith("vllm-kimi-k3-moe check: error: ")
    assert rule in check_refusal
    assert len(check_refusal.splitlines()) == 1


def test_pipeline_stages_each_load_their_layers(write, capsys) -> None:
    """vLLM splits the 3 decoder layers 2 + 1: stage 0 holds MoE layer 1,
    stage 1 MoE layer 2, each over its own 4 GPUs; DCP moves no weight."""
    status, out = check(capsys, str(write()), "--tp", "4", "--pp", "2", "--dcp", "4")
    assert status == 0, out
    layer = 8 * (2 * (3072 * 128 + 3072 * 8) + 256 * 1536 + 256 * 96)  # bytes
    lines = [line for line in out.splitlines() if line.startswith(("per G", "stage"))]
    assert lines == [
        "per GPU     TP4 DCP4 x PP2 without expert parallelism: each stage's 4 "
        "GPUs load its MoE layers alone (GPU r: the r-th of them)",
        "stage 0     decoder layers 0-1 (MoE layers 1): all 8 experts, 768 of 3072 "
        "intermediate rows each (GPU r: rows 768r to 768r+767); "
        f"{layer / 4 / 1e6:.2f} MB of routed-expert checkpoint data",
        "stage 1     decoder layer 2 (MoE layers 2): all 8 experts, 768 of 3072 "
        "intermediate rows each (GPU r: rows 768r to 768r+767); "
        f"{layer / 4 / 1e6:.2f} MB of routed-expert checkpoint data",
    ]
    assert "MTP draft layers 3: in no stage above" in out
    assert "DCP         4 GPUs of each TP group share the MLA KV cache" in out


def test_a_serve_command_checks_the_layout_it_asks_for(write, capsys) -> None:
    """The line read by vLLM's parser (its aliases too) is the same check
    as the options; its model is the checkpoint unless one is given."""
    directory = write()
    status, by_options = check(
        capsys, str(directory), "--tp", "4", "--pp", "2", "--dcp", "4"
    )
    serve = f"vllm serve {directory} -tp 4 --pipeline-parallel-size 2 -dcp 4 --port 1"
    assert (
        check(capsys, "--serve-command", serve)
        == (status, by_options)
        == (
            0,
            by_options,
        )
    )
    assert check(capsys, str(directory), "--serve-command", serve)[1] == by_options


def test_every_nodes_line_of_a_launch_checks_its_layout(write, capsys) -> None:
    """The lines ``plan`` prints for a layout over nodes (here TP4 x PP2 on
    nodes of 4 GPUs: node 0's, and node 1's, headless) check the layout the
    options give, its ``--moe-backend`` too."""
    directory = write()
    deployment = Deployment(4, pp_size=2, dcp_size=4)
    by_options = check(
        capsys,
        str(directory),
        "--tp",
        "4",
        "--pp",
        "2",
        "--dcp",
        "4",
        "--moe-backend",
        "marlin",
    )
    lines = serve_commands(deployment, Serving(), model=str(directory), gpus_per_node=4)
    assert len(lines) == 2 and lines[1].endswith("--headless")
    for line in lines:
        assert check(capsys, "--serve-command", line) == by_options


@pytest.mark.parametrize(
    ("serve", "args", "words"),
    [
        # vLLM's parser takes these; the topology rules refuse them as plan does
        ("-tp 8 -dcp 16", ["--tp", "8", "--dcp", "16"], ["dcp_size"]),
        ("-tp 8 --prefill-context-parallel-size 2", ["--pcp", "2"], ["MLA"]),
        ("-tp 5", ["--tp", "5"], ["heads"]),
        ("-tp 3", ["--tp", "3"], ["TP sizes that work: 1, 2, 4, 8, 16, 32"]),
    ],
)
def test_a_serve_command_is_refused_as_plan_refuses_it(
    tmp_path, capsys, serve, args, words
) -> None:
    """The released config.json alone: the refusal comes before any shard."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED.config()))
    refusals = []
    for command in (
        ["plan", "--config", str(tmp_path / "config.json"), *args],
        ["check", "--serve-command", f"vllm serve {tmp_path} {serve}"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 2
        refusals.append(capsys.readouterr().err.splitlines()[-1])
    plan_refusal, check_refusal = refusals
    assert check_refusal == plan_refusal.replace(" plan: ", " check: ", 1)
    for word in words:
        assert word in check_refusal


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--serve-command", "vllm serve /m -tp 8", "--tp", "8"], ["drop --tp"]),
        (["--serve-command", "vllm serve /m", "--ep", "--dcp", "2"], ["--ep, --dcp"]),
        (["--serve-command", "vllm server /m"], ["'vllm serve'"]),
        # vLLM's parser takes -tp and --tensor-parallel-size, not --tp (the
        # model, /, is a directory: the line reaches vLLM's parser)
        (["--serve-command", "vllm serve / --tp 8"], ["unrecognized", "--tp"]),
        # vLLM's launch rules over nodes, in its words
        (["--serve-command", "vllm serve / -tp 32 --nnodes 3"], ["evenly divide"]),
        (
            ["--serve-command", "vllm serve / -tp 8 --nnodes 2 --node-rank 2"],
            ["--node-rank must be between 0 and 1"],
        ),
        ([], ["CHECKPOINT_DIR"]),
    ],
)
def test_bad_serve_commands_are_one_line(capsys, args, words) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["check", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("vllm-kimi-k3-moe check: error: ")
    for word in words:
        assert word in err


def test_expert_parallel_share(write, capsys) -> None:
    status, out = check(capsys, str(write()), "--tp", "4", "--ep")
    assert status == 0
    assert (
        "TP4 with expert parallelism: 2 of 8 experts (GPU r: experts 2r to 2r+1)" in out
    )


def test_an_uneven_expert_parallel_share_is_vllms(tmp_path, capsys) -> None:
    """7 experts (a pruned count) over 4 GPUs: vLLM builds it, GPUs 0-2
    holding 2 experts, GPU 3 the last one; the JSON says the same."""
    directory = tmp_path / "pruned"
    write_header_only_checkpoint(directory, dataclasses.replace(SPEC, num_experts=7))
    status, out = check(capsys, str(directory), "--tp", "4", "--ep")
    assert status == 0
    assert "7 experts over 4 GPUs, as vLLM places them (the first 3 one more)" in out
    assert "GPUs 0-2: 2 experts each (GPU r: experts 2r to 2r+1)" in out
    assert "GPU 3: 1 expert, the rest in order from expert 6; 3.76 MB" in out
    status, out = check(capsys, str(directory), "--tp", "4", "--ep", "--json")
    per_gpu = json.loads(out)["per_gpu"]
    assert [gpu["experts"] for gpu in per_gpu] == [[0, 2], [2, 4], [4, 6], [6, 7]]


def set_quantization(directory: Path, quantization_config) -> None:
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config
    config_path.write_text(json.dumps(config))


def test_other_compressed_tensors_mxfp4_formats_take_vllms_ct_path(
    write, capsys
) -> None:
    directory = write()
    config = SPEC.config()["quantization_config"]
    set_quantization(directory, {**config, "format": "pack-quantized"})
    status, out = check(capsys, str(directory))
    assert status == 0
    assert "vLLM loads its experts with CompressedTensorsW4A4Mxfp4MoEMethod" in out


def no_directory(directory: Path) -> Path:
    return directory / "nowhere"


def a_file(directory: Path) -> Path:
    return directory / "config.json"


def no_config(directory: Path) -> Path:
    (directory / "config.json").unlink()
    return directory


def int8_channel(directory: Path) -> Path:
    """compressed-tensors, but a scheme no Kimi-K3 release uses."""
    config = SPEC.config()["quantization_config"]
    weights = {"num_bits": 8, "type": "int", "strategy": "channel"}
    group = {**config["config_groups"]["group_0"], "weights": weights}
    set_quantization(
        directory, {**config, "format": "int-quantized", "config_groups": {"g": group}}
    )
    return directory


def fp8(directory: Path) -> Path:
    set_quantization(directory, {"quant_method": "fp8"})
    return directory


def no_shards(directory: Path) -> Path:
    for path in directory.glob("*.safetensors*"):
        path.unlink()
    return directory


def another_model(directory: Path) -> Path:
    """A Llama's config.json (Meta-Llama-3-8B's, cut to its shape)."""
    llama = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32}
    (directory / "config.json").write_text(json.dumps(llama))
    return directory


def unreadable_index(directory: Path) -> Path:
    (directory / "model.safetensors.index.json").write_text("{")
    return directory


def test_a_text_only_checkpoint_is_read_under_model_layers(write, capsys) -> None:
    """Without a nested text_config, vLLM's Kimi text model loads
    ``model.layers.N...``; the multimodal names are then unexpected."""

    def rename(shards: Shards) -> None:
        for shard in shards:
            for name in [n for n in shard if n.startswith("language_model.layers.")]:
                shard["model." + name.removeprefix("language_model.")] = shard.pop(name)

    directory = write(rename)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    flat = {
        **config.pop("text_config"),
        "quantization_config": config["quantization_config"],
    }
    config_path.write_text(json.dumps(flat))
    status, out = check(capsys, str(directory))
    assert status == 0, out
    assert "144 expected, 144 found" in out

    write_checkpoint(directory, SPEC)  # multimodal names again, flat config kept
    config_path.write_text(json.dumps(flat))
    status, out = check(capsys, str(directory))
    assert status == 1
    assert out.splitlines()[0] == (  # the cause, first
        "MISMATCH    config.json has no text_config, so vLLM's Kimi-K3 loader reads "
        "the experts as model.layers.N.block_sparse_moe.experts.E.*, but the "
        "checkpoint names them language_model.layers.N.block_sparse_moe.experts.E.*"
    )
    assert "missing: model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in out
    assert f"unexpected: {GATE}: " in out


@pytest.mark.parametrize(
    ("make_input", "expected"),
    [
        (no_directory, "does not exist"),
        (a_file, "config.json is a file, not a checkpoint directory"),
        (no_config, "config.json does not exist"),
        (int8_channel, "int-quantized with 8-bit int channel weights; check knows"),
        (fp8, "quantization_config.quant_method 'fp8'; check knows"),
        (no_shards, "holds neither model.safetensors.index.json nor *.safetensors"),
        (unreadable_index, "is not a usable safetensors index"),
        (another_model, "is a llama model (model_type 'llama'), not Kimi-K3"),
    ],
)
def test_unusable_input_is_one_line_and_status_2(
    make_input, expected, write, capsys
) -> None:
    directory = make_input(write())
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(directory)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("auto", "resolved by vLLM from the GPU"), ("cutlass", "unknown MoE backend")],
)
def test_a_bad_moe_backend_is_refused_before_reading_shards(
    backend, expected, write, capsys
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(write()), "--moe-backend", backend])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_moe_backend_adds_vllms_own_allocation(kimi_model, write, capsys) -> None:
    directory = str(write())
    status, out = check(capsys, directory, "--moe-backend", "marlin")
    assert status == 0
    assert (
        f"on marlin, by {VLLM}'s own layer: 128 intermediate rows per expert "
        "with this plugin (upstream 256)"
    ) in out
    status, out = check(capsys, directory, "--moe-backend", "marlin", "--json")
    assert status == 0
    allocation = json.loads(out)["allocation"]  # stdout is the JSON alone
    assert allocation["backend"] == "marlin"
    assert allocation["intermediate_per_rank"] == {"plugin": 128, "upstream": 256}
    # no --gpu: built as vLLM builds on any NVIDIA GPU, and said so
    assert allocation["planned_for"] == {
        "gpu": None,
        "vendor": "nvidia",
        "architecture": None,
        "vendor_assumed": True,
    }


def test_with_pipeline_stages_the_allocation_is_per_stage(
    kimi_model, write, capsys
) -> None:
    """A GPU of a stage holds its stage's MoE layers only: the stages' lines
    (one MoE layer each here) add up to what one GPU holds without them."""
    directory = str(write())
    documents = []
    for pp in ("1", "2"):
        args = (directory, "--tp", "4", "--pp", pp, "--moe-backend", "marlin")
        status, out = check(capsys, *args, "--json")
        assert status == 0
        documents.append(json.loads(out)["allocation"]["routed_bytes_per_gpu"])
    whole, staged = documents
    by_stage = staged["by_stage"]
    assert [s["plugin"] for s in by_stage] == [whole["plugin"] // 2] * 2
    assert staged["plugin"] == whole["plugin"] // 2  # the heaviest GPU's
    status, out = check(
        capsys, directory, "--tp", "4", "--pp", "2", "--moe-backend", "marlin"
    )
    half = f"{whole['plugin'] / 2 / 1e6:.2f} MB per GPU over its 1 MoE layer"
    for stage in (0, 1):
        assert f"stage {stage}: {half}" in out
    assert "over the 2 main-model MoE layers" not in out


def test_header_only_checkpoints_are_what_safetensors_reads(tmp_path, capsys) -> None:
    """The benchmark's real-size header set is written by hand; at tiny size,
    safetensors itself must read it as the generated tensors, and check must
    pass it."""
    count = write_header_only_checkpoint(tmp_path, SPEC)
    tensors = checkpoint_tensors(SPEC)
    assert count == len(tensors)
    seen = 0
    for shard in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(shard, "pt") as file:
            for name in file.keys():  # noqa: SIM118 (safe_open is no dict)
                sliced = file.get_slice(name)
                assert sliced.get_shape() == list(tensors[name].shape), name
                assert sliced.get_dtype() == {torch.uint8: "U8"}.get(
                    tensors[name].dtype, "BF16"
                )
                seen += 1
    assert seen == len(tensors)
    status, out = check(capsys, str(tmp_path))
    assert status == 0, out


def test_layers_pruned_to_different_expert_counts_are_named_first(
    write, capsys
) -> None:
    """Layer 2 pruned to 6 experts, the others keeping 8: the cause leads,
    in one line; each missing tensor is still listed."""
    gone = [
        name
        for name in checkpoint_tensors(SPEC)
        if ".layers.2.block_sparse_moe.experts.6." in name
        or ".layers.2.block_sparse_moe.experts.7." in name
    ]
    status, out = check(capsys, str(write(remove(*gone))))
    assert status == 1
    assert out.splitlines()[0] == (
        "MISMATCH    the MoE layers hold different numbers of experts (layer 2: "
        "6, layer 1: 8); vLLM builds every MoE layer with config.json's "
        "num_experts (8), so a checkpoint pruned layer by layer cannot be served"
    )
    assert f"missing: {expert_tensor_name(2, 6, 'w1', 'weight_packed')}" in out
    assert out.splitlines()[-1] == (
        "FAILED      12 problems: prune every MoE layer to the same expert count "
        "before launching vLLM"
    )


@pytest.mark.parametrize("command", ["plan", "check"])
def test_a_config_with_per_layer_expert_counts_is_refused(
    command, tmp_path, capsys
) -> None:
    config = RELEASED.config()
    config["text_config"]["num_experts_per_layer"] = [896] + [806] * 91
    (tmp_path / "config.json").write_text(json.dumps(config))
    where = ["--config", str(tmp_path)] if command == "plan" else [str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main([command, *where])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "num_experts_per_layer gives its layers different expert counts (806 to "
        "896); vLLM builds every MoE layer with num_experts (896), so layers "
        "pruned unevenly cannot be served\n"
    )


# The latent adapters of MoE layer 1, [output, input] (the tiny spec: the
# residual 512 wide, the experts 256).
UP_PROJ = "language_model.layers.1.block_sparse_moe.routed_expert_up_proj"
DOWN_PROJ = "language_model.layers.1.block_sparse_moe.routed_expert_down_proj"


def test_the_adapters_are_checked_as_the_config_builds_them(write, capsys) -> None:
    """The release's config leaves the adapters BF16: every layer's two are
    checked (3 MoE layers x 2), and a broken one is a problem."""
    status, out = check(capsys, str(write()))
    assert status == 0, out
    assert (
        "adapters    routed_expert_down_proj and up_proj per layer, BF16, left "
        "unquantized by config.json: 6 expected, 6 found and checked"
    ) in out
    wrong = torch.ones((256, 512), dtype=torch.bfloat16)  # down's shape, up's name
    status, out = check(capsys, str(write(replace(f"{UP_PROJ}.weight", wrong))))
    assert status == 1
    assert (
        f"shape: {UP_PROJ}.weight: is [256, 512], expected [512, 256], BF16 "
        "(config.json leaves the adapters unquantized)"
    ) in out


def quantize_the_adapters(directory: Path) -> None:
    """config.json's ignore list without the adapters: vLLM then builds
    them quantized as the experts (MXFP4)."""
    config = json.loads((directory / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    config["quantization_config"]["ignore"] = [
        entry for entry in ignore if "routed_expert" not in entry
    ]
    (directory / "config.json").write_text(json.dumps(config))


def test_adapters_a_config_quantizes_must_be_stored_quantized(write, capsys) -> None:
    directory = write()
    quantize_the_adapters(directory)
    status, out = check(capsys, str(directory), "--all")
    assert status == 1
    assert (
        f"missing: {UP_PROJ}.weight_packed: expected [512, 128] U8, quantized as "
        "its experts (config.json quantizes the adapters)"
    ) in out
    assert f"unexpected: {UP_PROJ}.weight: vLLM builds this layer's adapters" in out

    def mxfp4_adapters(shards: Shards) -> None:
        for layer in (1, 2, 3):
            for name, (output, input_) in {
                "routed_expert_down_proj": (256, 512),
                "routed_expert_up_proj": (512, 256),
            }.items():
                base = f"language_model.layers.{layer}.block_sparse_moe.{name}"
                del holding(shards, f"{base}.weight")[f"{base}.weight"]
                shards[-1][f"{base}.weight_packed"] = bytes_of(output, input_ // 2)
                shards[-1][f"{base}.weight_scale"] = bytes_of(output, input_ // 32)

    directory = write(mxfp4_adapters)
    quantize_the_adapters(directory)
    status, out = check(capsys, str(directory))
    assert status == 0, out
    assert (
        "adapters    routed_expert_down_proj and up_proj per layer, quantized as "
        "the experts (weight_packed, weight_scale): 12 expected, 12 found"
    ) in out
