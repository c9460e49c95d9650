"""``check`` on a badly broken checkpoint: one screen, the cause first.

Problems are counted per kind and per shard before a few of each are shown
(``--all``: every one); a shard that cannot be read is one line; expert
tensors in another format than ``config.json`` declares are named in the
first line; ``--json`` carries the summary, every problem and each GPU's
share. Header-only checkpoints (``format_checkpoints``), tiny and at the
release's size.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.models.kimi_k3.format_checkpoints import (
    FORMAT_TENSORS,
    write_format_checkpoint,
)
from tests.models.kimi_k3.kimi_k3_checkpoint import (
    KimiK3Spec,
    expert_tensor_name,
    expert_tensors,
    shard_name,
    write_header_only_checkpoint,
    write_headers,
)
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.tools.cli import main

SPEC = KimiK3Spec()  # 3 MoE layers (MTP included) x 8 experts, 3 shards
SCREEN = 40  # lines
EXPERTS = range(SPEC.num_experts)


def check(capsys, *args: str) -> tuple[int, str]:
    status = main(["check", *args])
    return status, capsys.readouterr().out


def broken_fp8_checkpoint(directory: Path) -> Path:
    """FP8 block (three lines of per-GPU share at TP32), with every kind of
    problem several times over in layer 1 and a middle shard deleted."""

    def corrupt(entries):
        def name(expert, projection, suffix):
            return expert_tensor_name(1, expert, projection, suffix)

        halved = {name(e, "w1", "weight") for e in EXPERTS}
        retyped = {name(e, "w2", "weight") for e in EXPERTS}
        dropped = {name(e, "w3", "weight_scale") for e in EXPERTS}
        for index, (entry, dtype, shape) in enumerate(entries):
            if entry in halved:
                entries[index] = (entry, dtype, (shape[0] // 2, shape[1]))
            elif entry in retyped:
                entries[index] = (entry, "BF16", shape)
        entries[:] = [entry for entry in entries if entry[0] not in dropped]
        doubled = {name(e, "w3", "weight") for e in range(5)}  # in the first shard
        strays = [(name(e, "w1", "weight_zero_point"), "I32", (1,)) for e in EXPERTS]
        entries += [e for e in entries if e[0] in doubled] + strays[:6]  # last shard

    write_format_checkpoint(directory, "fp8-block", edit=corrupt)
    (directory / shard_name(1, 3)).unlink()
    return directory


# 8 of each corruption (one per expert of layer 1), 5 duplicates, 6 strays
BROKEN_COUNTS = "1 shard, 8 missing, 8 shape, 8 dtype, 5 duplicate, 6 unexpected"


def test_a_badly_broken_checkpoint_fits_one_screen(tmp_path, capsys) -> None:
    status, out = check(capsys, str(broken_fp8_checkpoint(tmp_path)))
    assert status == 1
    lines = out.splitlines()
    assert len(lines) <= SCREEN, out
    assert lines[0].startswith("checkpoint  ")  # no cause to name first
    assert "2 of 3 headers read" in lines[2]
    assert f"problems    36: {BROKEN_COUNTS}" in lines
    by_shard = lines.index(  # the unreadable shard first, then by count
        f"by shard    {shard_name(1, 3)}: unreadable, incomplete or missing"
    )
    assert lines[by_shard + 1 : by_shard + 4] == [
        f"            {shard_name(0, 3)}: 8 shape, 8 dtype",
        f"            {shard_name(2, 3)}: 5 duplicate, 6 unexpected",
        "            in no shard: 8 missing",
    ]
    for kind, more in [
        ("missing", 5),
        ("shape", 5),
        ("dtype", 5),
        ("duplicate", 2),
        ("unexpected", 3),
    ]:
        shown = [line for line in lines if line.startswith(f"  {kind}: ")]
        assert len(shown) == 3, kind
        assert f"  ... and {more} more {kind} problems (--all lists every one)" in (
            lines
        )
    assert lines[-1] == (
        "FAILED      36 problems: fix the checkpoint before launching vLLM"
    )


def test_all_lists_every_problem(tmp_path, capsys) -> None:
    status, out = check(capsys, str(broken_fp8_checkpoint(tmp_path)), "--all")
    assert status == 1
    listed = Counter(
        match.group(1)
        for line in out.splitlines()
        if (match := re.match(r"  (\w+): ", line))
    )
    assert listed == {
        "shard": 1,
        "missing": 8,
        "shape": 8,
        "dtype": 8,
        "duplicate": 5,
        "unexpected": 6,
    }


def test_json_has_the_summary_every_problem_and_each_gpus_share(
    tmp_path, capsys
) -> None:
    status, out = check(capsys, str(broken_fp8_checkpoint(tmp_path)), "--json")
    assert status == 1
    report = json.loads(out)
    assert report["status"] == 1
    assert report["headline"] is None
    assert report["format"]["name"] == "fp8-block"
    assert report["shards"] == {"in_checkpoint": 3, "headers_read": 2}
    problems = report["problems"]
    assert report["summary"]["problems"] == len(problems) == 36
    kinds = Counter(problem["kind"] for problem in problems)
    assert report["summary"]["by_kind"] == dict(kinds)
    per_shard = Counter((p["shard"] or "in no shard", p["kind"]) for p in problems)
    assert {
        (shard, kind): n
        for shard, counts in report["summary"]["by_shard"].items()
        for kind, n in counts.items()
    } == dict(per_shard)
    (lost,) = [p for p in problems if p["kind"] == "shard"]
    assert lost["subject"] == lost["shard"] == shard_name(1, 3)
    # FP8 blocks are loaded whole at TP32: GPUs 0-23 a block each, 24-31 none
    assert [share["rows"] for share in report["per_gpu"]] == [
        *([128 * r, 128 * r + 128] for r in range(24)),
        *([3072, 3072] for _ in range(8)),
    ]
    assert {tuple(share["experts"]) for share in report["per_gpu"]} == {(0, 8)}


def test_json_of_a_clean_checkpoint(tmp_path, capsys) -> None:
    write_header_only_checkpoint(tmp_path, SPEC)
    status, out = check(capsys, str(tmp_path), "--json", "--tp", "4", "--ep")
    assert status == 0
    report = json.loads(out)
    assert report["problems"] == [] and report["summary"]["problems"] == 0
    assert (
        report["expert_tensors"]["expected"] == report["expert_tensors"]["found"] == 144
    )
    assert report["topology"] == {
        "tp_size": 4,
        "dp_size": 1,
        "expert_parallel": True,
        "pp_size": 1,
        "dcp_size": 1,
        "gpus": 4,
    }
    assert [share["experts"] for share in report["per_gpu"]] == [
        [0, 2], [2, 4], [4, 6], [6, 8]
    ]  # fmt: skip
    assert {tuple(share["rows"]) for share in report["per_gpu"]} == {(0, 3072)}
    assert "stages" not in report


def test_json_has_each_pipeline_stages_share(tmp_path, capsys) -> None:
    write_header_only_checkpoint(tmp_path, SPEC)
    status, out = check(capsys, str(tmp_path), "--json", "--tp", "2", "--pp", "2")
    assert status == 0
    report = json.loads(out)
    assert report["topology"]["pp_size"] == 2 and report["topology"]["gpus"] == 4
    stages = report["stages"]
    # vLLM's split of 3 decoder layers over 2 stages: 2 + 1
    assert [(s["layers"], s["moe_layers"]) for s in stages] == [
        ([0, 2], [1]),
        ([2, 3], [2]),
    ]
    for stage in stages:
        assert [share["rows"] for share in stage["per_gpu"]] == [
            [0, 1536],
            [1536, 3072],
        ]
    # each stage's GPUs load one of the checkpoint's 3 MoE layers (MTP included)
    per_layer = report["bytes"]["routed_experts"] / 3
    assert stages[0]["per_gpu"][0]["routed_expert_bytes"] == round(per_layer / 2)
    # per_gpu: each of the 4 GPUs, with what its own stage loads
    assert [(g["stage"], g["gpu"]) for g in report["per_gpu"]] == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    for gpu in report["per_gpu"]:
        (same,) = [g for g in stages[gpu["stage"]]["per_gpu"] if g["gpu"] == gpu["gpu"]]
        assert gpu == {"stage": gpu["stage"], **same}
    assert report["per_gpu"][0]["routed_expert_bytes"] == round(per_layer / 2)


def test_json_does_not_change_an_unusable_input_refusal(tmp_path, capsys) -> None:
    write_header_only_checkpoint(tmp_path, SPEC)
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(tmp_path), "--json", "--tp", "5"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "tensor-parallel size 5" in captured.err


def drop_quantization_config(directory: Path) -> None:
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]
    config_path.write_text(json.dumps(config))


LOST_MXFP4 = (
    "MISMATCH    config.json declares no quantization but the expert tensors are "
    "MXFP4-packed (weight_packed U8, weight_scale U8 per projection)"
)


def test_a_lost_quantization_config_is_named_first(tmp_path, capsys) -> None:
    write_header_only_checkpoint(tmp_path, SPEC)
    drop_quantization_config(tmp_path)
    status, out = check(capsys, str(tmp_path))
    assert status == 1
    lines = out.splitlines()
    assert lines[0] == LOST_MXFP4
    assert "problems    216: 72 missing, 144 unexpected" in lines
    assert lines[-1] == (
        "FAILED      216 problems: make config.json declare the format the "
        "expert tensors are in (first line) before launching vLLM"
    )


# How each published format's expert tensors are named when config.json
# declares the release's MXFP4 instead
STORED_AS = {
    "fp8-block": "FP8 with block scales (weight F8_E4M3, weight_scale BF16 or F16 "
    "or F32 per projection)",
    "nvfp4": "NVFP4-packed (compressed-tensors names) (weight_packed U8, "
    "weight_scale F8_E4M3, weight_global_scale F32, input_global_scale F32 per "
    "projection)",
    "modelopt-nvfp4": "NVFP4-packed (ModelOpt names) (weight U8, weight_scale "
    "F8_E4M3, weight_scale_2 F32, input_scale F32 per projection)",
    "w4a16": "INT-packed (WNA16) (weight_packed I32, weight_scale BF16 or F16 or "
    "F32, weight_shape I64 or I32 per projection)",
    "awq": "INT4-packed (AutoAWQ qweight/qzeros/scales) (qweight I32, qzeros I32, "
    "scales BF16 or F16 or F32 per projection)",
    "gptq": "INT-packed (AutoGPTQ qweight/qzeros/scales) (qweight I32, qzeros I32, "
    "scales BF16 or F16 or F32 per projection)",
    "bf16": "unquantized BF16 (weight BF16 per projection)",
}


@pytest.mark.parametrize("fmt", FORMAT_TENSORS)
def test_expert_tensors_of_another_format_are_named(tmp_path, capsys, fmt) -> None:
    def declare_mxfp4(entries):  # the tensors stay fmt's
        pass

    write_format_checkpoint(tmp_path, fmt, edit=declare_mxfp4)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = SPEC.config()["quantization_config"]
    config_path.write_text(json.dumps(config))
    status, out = check(capsys, str(tmp_path))
    assert status == 1
    assert out.splitlines()[0] == (
        "MISMATCH    config.json declares compressed-tensors mxfp4-pack-quantized "
        f"but the expert tensors are {STORED_AS[fmt]}"
    )


def test_fp8_declared_nvfp4_stored(tmp_path, capsys) -> None:
    write_format_checkpoint(tmp_path, "nvfp4")
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS["fp8-block"]
    config_path.write_text(json.dumps(config))
    status, out = check(capsys, str(tmp_path))
    assert status == 1
    assert out.startswith(
        "MISMATCH    config.json declares compressed-tensors FP8 block [128, 128] "
        "but the expert tensors are NVFP4-packed (compressed-tensors names)"
    )


def test_release_sized_lost_quantization_config_fits_one_screen(
    tmp_path, capsys
) -> None:
    """Before: 741,896 lines (155 MB) that never said the tensors look like
    MXFP4. The release's 92 MoE layers x 896 experts, headers only."""
    write_header_only_checkpoint(tmp_path, KimiK3Spec.released())
    drop_quantization_config(tmp_path)
    status, out = check(capsys, str(tmp_path))
    assert status == 1
    lines = out.splitlines()
    assert len(lines) <= SCREEN, out
    assert lines[0] == LOST_MXFP4
    assert "problems    741888: 247296 missing, 494592 unexpected" in lines


def test_expert_tensors_under_the_other_prefix_are_named(tmp_path, capsys) -> None:
    """Text-only names (``model.layers.``) under a multimodal config.json that
    also lost its quantization_config: both causes, in the first line."""
    entries = [
        (name.replace("language_model.layers.", "model.layers.", 1), "U8", shape)
        for name, shape in expert_tensors(SPEC)
    ]
    config = SPEC.config()
    del config["quantization_config"]
    write_headers(tmp_path, SPEC, entries, config)
    status, out = check(capsys, str(tmp_path))
    assert status == 1
    assert out.splitlines()[0] == (
        "MISMATCH    config.json nests text_config, so vLLM's Kimi-K3 loader reads "
        "the experts as language_model.layers.N.block_sparse_moe.experts.E.*, but "
        "the checkpoint names them model.layers.N.block_sparse_moe.experts.E.*, and "
        "they are MXFP4-packed (weight_packed U8, weight_scale U8 per projection)"
    )
