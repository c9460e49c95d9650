"""``vllm-kimi-k3-moe plan`` reports what vLLM's real Kimi-K3 MoE layers allocate
per GPU, matching independent arithmetic, and refuses bad input in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.models.kimi_k3 import kimi_k3_shapes as k3
from tests.models.kimi_k3.builders import MXFP4_FORMATS
from tests.models.kimi_k3.kimi_k3_formats import QUANTIZATION_CONFIGS
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.cli import build_parser, main
from vllm_kimi_k3_moe.tools.cli.plan import _plan_input
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_MOE_FIELDS,
    KIMI_K3_TEXT_CONFIG,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Serving,
)
from vllm_kimi_k3_moe.tools.plan.max_model_len import _refuse_non_lengths

MOE_LAYERS = 92  # 93 layers, the first one dense
BF16 = 2  # bytes
GB = 1e9
# Meta-Llama-3-8B's config.json, cut to its shape: a model without experts.
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


@pytest.fixture
def plan(kimi_k3_plan):
    """The MoE-layer figures of a deployment's plan (the whole model built,
    ``kimi_k3_plan``)."""
    return lambda deployment: kimi_k3_plan(deployment).moe


def routed_bytes(experts: int, intermediate: int) -> int:
    """MXFP4 w1, w3, w2 of ``experts`` experts at a per-rank intermediate: half a
    byte per value plus one scale byte per 32 values."""
    values = experts * 3 * k3.ROUTED_EXPERT_HIDDEN_SIZE * intermediate
    return values // 2 + values // 32


@pytest.fixture(scope="module")
def kimi_k3_plans(kimi_k3_deployment_plans) -> dict[int, object]:
    """The MoE-layer part of each whole-deployment plan."""
    return {tp: p.moe for tp, p in kimi_k3_deployment_plans.items()}


@pytest.mark.parametrize(
    ("tp", "logical", "upstream", "fixed", "gb_upstream", "gb_fixed", "gb_floor"),
    [
        (8, 384, 384, 384, 180.8, 180.8, 180.8),
        (16, 192, 256, 256, 120.5, 120.5, 90.4),  # 192 -> Marlin 256
        (32, 96, 256, 128, 120.5, 60.3, 45.2),  # model-level 256 vs Marlin 128
    ],
)
def test_routed_experts_per_gpu_on_marlin(
    kimi_k3_plans, tp, logical, upstream, fixed, gb_upstream, gb_fixed, gb_floor
):
    result = kimi_k3_plans[tp]
    assert result.moe_layers == MOE_LAYERS
    assert result.logical_intermediate_per_rank == logical
    assert result.upstream.intermediate_per_rank == upstream
    assert result.fixed.intermediate_per_rank == fixed
    assert result.upstream.routed_bytes == routed_bytes(k3.NUM_EXPERTS, upstream)
    assert result.fixed.routed_bytes == routed_bytes(k3.NUM_EXPERTS, fixed)
    assert result.floor_routed_bytes == routed_bytes(k3.NUM_EXPERTS, logical)
    totals = result.to_dict()["all_moe_layers"]
    assert round(totals["upstream_routed_bytes"] / GB, 1) == gb_upstream
    assert round(totals["fixed_routed_bytes"] / GB, 1) == gb_fixed
    assert round(totals["floor_routed_bytes"] / GB, 1) == gb_floor


def test_shared_and_latent_bytes_at_tp32(kimi_k3_plans):
    result = kimi_k3_plans[32]
    # Two shared experts of 3072 fused into one MLP of 6144, TP-sharded: gate+up
    # (2 * 6144 / 32 rows x 7168) and down (7168 x 6144 / 32), bf16.
    shared = (2 * 6144 // 32 * 7168 + 7168 * 6144 // 32) * BF16
    # Latent projections 7168 -> 3584 -> 7168, replicated on every GPU, bf16.
    latent = 2 * 7168 * 3584 * BF16
    for allocation in (result.upstream, result.fixed):
        assert allocation.shared_bytes == shared
        assert allocation.latent_bytes == latent
    assert result.fixed.total_bytes > (
        result.fixed.routed_bytes + result.fixed.shared_bytes + latent
    )  # plus the router


def test_expert_parallel_holds_whole_experts(plan):
    result = plan(Deployment(32, expert_parallel=True))
    assert result.fixed.local_experts == 896 // 32
    assert result.logical_intermediate_per_rank == 3072
    assert result.upstream.intermediate_per_rank == 3072
    assert result.fixed == result.upstream
    assert result.fixed.routed_bytes == routed_bytes(28, 3072)


@pytest.mark.parametrize(
    ("deployment", "upstream", "fixed"),
    [
        # The compressed-tensors method pads only with the plugin.
        (Deployment(32, quantization="ct-mxfp4"), 256, 128),
        # b12x plans for the exact dimensions: the fixed layer is the floor.
        (Deployment(32, backend="b12x"), 256, 96),
        # compressed-tensors MXFP4 on a GPU that runs CUTLASS: 128-row tiles
        (Deployment(16, backend="cutlass", quantization="ct-mxfp4"), 256, 256),
        # DP without EP: vLLM shards each expert over TP x DP = 32 GPUs (96),
        # while upstream's model-level minimum looks at TP8 only (384): both
        # leave the padding to Marlin.
        (Deployment(8, dp_size=4), 128, 128),
    ],
)
def test_other_paths_and_kernels(plan, deployment, upstream, fixed):
    result = plan(deployment)
    assert result.upstream.intermediate_per_rank == upstream
    assert result.fixed.intermediate_per_rank == fixed


def test_wide_table_has_every_column(kimi_model, capsys):
    assert main(["plan", "--wide"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line}
    # config GPUs nodes experts | I: logical upstream fixed | GB/layer x3 | GB x92 x3
    assert rows["TP8"][:7] == ["TP8", "8", "1", "896", "384", "384", "384"]
    assert rows["TP8"][10:13] == ["180.8", "180.8", "180.8"]
    assert rows["TP16"][2:7] == ["2", "896", "192", "256", "256"]
    assert rows["TP16"][10:13] == ["120.5", "120.5", "90.4"]
    assert rows["TP32"][2:7] == ["4", "896", "96", "256", "128"]
    assert rows["TP32"][10:13] == ["120.5", "60.3", "45.2"]
    assert "importing vLLM" in err


def test_wide_table_keeps_the_default_tables_words(kimi_k3_deployment_plans):
    """--wide adds columns, not names: vLLM (alone) and plugin, as the
    default table, and the same group labels for the same figures."""
    from vllm_kimi_k3_moe.tools.plan.report import table, wide_table

    plans = [kimi_k3_deployment_plans[tp] for tp in (8, 16, 32)]
    wide, default = wide_table(plans), table(plans)
    groups, columns = wide.splitlines()[2:4]
    assert columns.split()[:4] == ["layout", "GPUs", "nodes", "experts"]
    assert set(columns.split()[4:]) == {"logical", "vLLM", "plugin", "floor"}
    for label in ("weights GB/GPU", "fits", "KV tokens", "requests"):
        assert label in groups
    for word in ("upstream", "fixed"):
        assert word not in wide and word not in default


def test_default_table_fits_120_columns_and_says_why(kimi_model, capsys):
    assert main(["plan", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line}
    # layout GPUs nodes | weights vLLM plugin | fits vLLM plugin | KV tokens
    # requests; weights with the vision tower vLLM serves by default (0.9 GB)
    assert rows["TP32"][:7] == ["TP32", "32", "4", "136.1", "75.9", "no", "no"]
    assert "weights+reserve" in " ".join(rows["TP32"][9:])


def test_json_with_fit_check(kimi_model, capsys):
    assert main(["plan", "--tp", "32", "--json", "--gpu-memory-gib", "96"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    assert document["deployment"]["tp_size"] == 32
    assert document["fixed_per_layer"]["intermediate_per_rank"] == 128
    assert document["all_moe_layers"]["fixed_routed_bytes"] == 92 * routed_bytes(
        896, 128
    )
    # The whole model: 136.1 GB upstream exceeds vLLM's share of 96 GiB on its
    # own (0.92 of it on vLLM 0.33, all of it on 0.34); 75.9 GB fixed leaves
    # the share less the reserve and the weights (test_kv_budget).
    assert document["fits"] == {
        "gpu_memory_gib": 96,
        "upstream": False,
        "fixed": True,
        "plugin_makes_it_fit": True,
    }
    assert document["reason"] is None
    assert document["deployment"]["pp_size"] == 1
    whole = document["whole_model"]
    gpu = document["gpu"]
    assert whole["upstream_bytes"] > gpu["requested_bytes"] > whole["fixed_bytes"]
    kv = document["kv_cache"]
    assert kv["upstream_tokens"] == 0
    assert kv["fixed_available_bytes"] == (
        gpu["requested_bytes"]
        - whole["fixed_bytes"]
        - round(gpu["reserve_gib"] * 2**30)
    )
    # 24 MLA layers x 576 bf16 values per token; a block is 256 tokens at TP32
    assert kv["fixed_tokens"] > kv["fixed_available_bytes"] // (24 * 576 * 2) * 0.9
    assert kv["fixed_tokens"] % 131072 != 0  # concurrency x max_model_len


def test_a_dcp_row_has_its_tps_weights_and_more_kv_cache(kimi_k3_h20_planner):
    from vllm_kimi_k3_moe.tools.plan.report import table

    plans = [kimi_k3_h20_planner.plan(Deployment(32, dcp_size=dcp)) for dcp in (1, 32)]
    text = table(plans)
    assert max(len(line) for line in text.splitlines()) <= 120
    rows = {line[:12].strip(): line[12:].split() for line in text.splitlines()}
    # GPUs nodes | weights vLLM plugin | fits vLLM plugin | KV tokens ...
    assert rows["TP32 DCP32"][:6] == rows["TP32"][:6] == [
        "32", "4", "136.1", "75.9", "no", "yes"
    ]  # fmt: skip
    tokens = [int(rows[name][6].replace(",", "")) for name in ("TP32", "TP32 DCP32")]
    assert tokens[1] > 10 * tokens[0]  # 8.5 M against 0.41 M
    assert "changes no weight" in text
    document = plans[1].to_dict()
    assert document["deployment"]["dcp_size"] == 32
    assert document["kv_cache_per_gpu"]["dcp_size"] == 32
    assert "--decode-context-parallel-size 32" in document["serve_command"]


def test_config_file_with_nested_text_config(kimi_model, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "architectures": ["KimiK3ForConditionalGeneration"],
                "quantization_config": mxfp4.RELEASE.published_quantization_config(),
                "vision_config": {"hidden_size": 1152},
                "text_config": KIMI_K3_TEXT_CONFIG,
            }
        )
    )
    assert main(["plan", "--config", str(config), "--tp", "32", "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    assert document["moe_layers"] == 92
    assert document["fixed_per_layer"]["routed_bytes"] == routed_bytes(896, 128)


# RedHatAI's Kimi-K3-NVFP4-REAP10 keeps 806 of the 896 experts (REAP prunes
# every layer alike and writes the new count). Over 8 expert-parallel GPUs
# vLLM gives GPUs 0-5 101 experts and GPUs 6-7 100 (806 = 8 x 100 + 6).
PRUNED_EXPERTS, HEAVIEST_OF_8 = 806, 101


def test_a_pruned_checkpoint_is_sized_on_its_heaviest_gpu_and_served_by_name(
    kimi_model, tmp_path, capsys
):
    """An uneven expert-parallel split is planned, not refused, sized on the
    GPU vLLM gives the most experts; the serve line names the directory
    whose config.json plan read, unless --model names another."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK3ForConditionalGeneration"],
                "text_config": {**KIMI_K3_TEXT_CONFIG, "num_experts": PRUNED_EXPERTS},
            }
        )
    )
    layout = ["--gpu", "b300", "--tp", "8", "--ep", "--json"]
    assert main(["plan", "--config", str(tmp_path), *layout]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    for side in ("upstream_per_layer", "fixed_per_layer"):
        assert document[side]["local_experts"] == HEAVIEST_OF_8
    assert document["serve_command"].startswith(f"vllm serve {tmp_path} ")
    named = ["--model", "RedHatAI/Kimi-K3-NVFP4-REAP10"]
    assert (
        main(["plan", "--config", str(tmp_path / "config.json"), *layout, *named]) == 0
    )
    (document,) = json.loads(capsys.readouterr().out)
    assert document["serve_command"].startswith(f"vllm serve {named[1]} ")


def write(tmp_path, content: str):
    path = tmp_path / "config.json"
    path.write_text(content)
    return str(path)


BAD_INPUT = [
    # (case, arguments, words the one-line error must contain)
    ("tp not dividing the heads", ["--tp", "7"], ["96", "7", "heads"]),
    # 96 heads and 163840 vocabulary rows split over TP1-TP32 alone (powers of 2)
    (
        "tp that builds nothing",
        ["--tp", "3"],
        ["TP 3", "; TP sizes that work: 1, 2, 4, 8, 16, 32"],
    ),
    (
        "tp with other sizes kept",
        ["--tp", "6", "--pp", "2", "--ep"],
        ["TP sizes that work with PP2 EP: 1, 2, 4, 8, 16, 32"],
    ),
    ("tp x dp not dividing", ["--tp", "8", "--dp", "5"], ["3072", "40 GPUs"]),
    (
        "tp not dividing the vocabulary",
        ["--tp", "24"],
        ["TP 24", "vocabulary of 163840"],
    ),
    ("more stages than layers", ["--pp", "94"], ["94", "93 layers"]),
    ("unknown gpu", ["--gpu", "a100"], ["'a100'", "h100", "--gpu-memory-gb"]),
    ("infinite memory", ["--gpu-memory-gib", "inf"], ["'inf'", "finite"]),
    (
        "nan utilization",
        ["--gpu", "h100", "--gpu-memory-utilization", "nan"],
        ["'nan'", "finite"],
    ),
    ("reserve without a gpu", ["--reserve-gib", "4"], ["--reserve-gib", "--gpu"]),
    ("advisor without a gpu", ["--gpus", "32"], ["--gpus", "GPU size"]),
    ("advisor with --tp", ["--gpus", "32", "--gpu", "h100", "--tp", "8"], ["--tp"]),
    (
        "both gpu and its memory",
        ["--gpu", "h100", "--gpu-memory-gib", "80"],
        ["--gpu", "not both"],
    ),
    (
        "both gpu and its memory in GB",
        ["--gpu", "h100", "--gpu-memory-gb", "85"],
        ["--gpu or --gpu-memory-gb", "not both"],
    ),
    ("gpu memory in GB negative", ["--gpu-memory-gb", "-1"], ["'-1'"]),
    ("tp zero", ["--tp", "0"], ["'0'", "positive"]),
    ("tp not a number", ["--tp", "eight"], ["'eight'"]),
    ("unknown backend", ["--moe-backend", "fastest"], ["'fastest'", "marlin"]),
    ("auto backend", ["--moe-backend", "auto"], ["auto", "GPU"]),
    (
        "backend not on compressed-tensors",
        ["--quantization", "ct-mxfp4", "--moe-backend", "deepgemm_mxfp4"],
        ["'deepgemm_mxfp4'", "ct-mxfp4"],
    ),
    ("unknown quantization", ["--quantization", "fp4"], ["'fp4'"]),
    ("gpu memory negative", ["--gpu-memory-gib", "-1"], ["'-1'"]),
    (
        "utilization above 1",
        ["--gpu-memory-gib", "80", "--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "(0, 1]", "1.5"],
    ),
    (
        "utilization 0",
        ["--gpu-memory-gib", "80", "--gpu-memory-utilization", "0"],
        ["(0, 1]", "got 0"],
    ),
    # 896 / 64 = 14 experts per GPU, but 96 heads do not split over TP64
    ("tp not dividing the heads", ["--tp", "64", "--ep"], ["96", "64", "heads"]),
    ("unknown kv cache dtype", ["--kv-cache-dtype", "fp4"], ["'fp4'"]),
    ("kv option and a bad tp", ["--max-model-len", "1000", "--tp", "7"], ["heads"]),
    (
        "backend not for the format",
        ["--quantization", "w4a16", "--moe-backend", "triton"],
        ["'triton'", "w4a16", "marlin"],
    ),
    # DCP groups are TP GPUs: vLLM's ParallelConfig needs DCP to divide TP
    ("dcp not dividing tp", ["--tp", "8", "--dcp", "16"], ["16", "8", "dcp_size"]),
    ("dcp with the defaults", ["--dcp", "3"], ["size 3", "tensor-parallel size 8"]),
    ("advisor with --dcp", ["--gpus", "8", "--gpu", "b300", "--dcp", "8"], ["--dcp"]),
    # vLLM 0.33.0's Kimi-K3 MLA layer asserts prefill context parallelism away
    ("pcp", ["--tp", "8", "--pcp", "2"], ["prefill-context-parallel size 2", "MLA"]),
    ("pcp in the advisor", ["--gpus", "8", "--gpu", "b300", "--pcp", "2"], ["MLA"]),
    # --max-model-len as vLLM's own parser function reads it (and refuses it)
    ("binary suffix with decimals", ["--max-model-len", "1.5K"], ["'1.5K'", "1.5k"]),
    ("not a length", ["--max-model-len", "abc"], ["'abc'", "128k = 128000"]),
    ("vLLM's auto length", ["--max-model-len", "auto"], ["'auto'", "start-up"]),
    ("no tokens", ["--max-model-len", "0"], ["'0'", "positive"]),
    # other input is refused first, without vLLM's parser
    ("bad length and tp", ["--max-model-len", "x", "--tp", "7"], ["heads"]),
]


@pytest.mark.parametrize(
    ("arguments", "words"),
    [case[1:] for case in BAD_INPUT],
    ids=[case[0] for case in BAD_INPUT],
)
def test_bad_input_is_one_line_and_exit_2(capsys, arguments, words):
    with pytest.raises(SystemExit) as exited:
        main(["plan", *arguments])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err


@pytest.mark.parametrize(
    ("arguments", "noted", "serving"),
    [
        (["--max-model-len", "1000"], "--max-model-len", Serving(max_model_len=1000)),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype", Serving("fp8")),
        (["--kv-cache-dtype", "fp8", "--json"], None, Serving("fp8")),
        (
            ["--max-model-len", "1000", "--gpu", "h20"],
            None,
            Serving(max_model_len=1000),
        ),
        ([], None, Serving()),
    ],
)
def test_kv_options_without_a_gpu_size_are_noted(capsys, arguments, noted, serving):
    """Without a GPU size the table has no KV cache: the KV options still
    reach the JSON and the serve commands, and the table says it ignores them."""
    args = build_parser().parse_args(["plan", "--tp", "8", *arguments])
    assert _plan_input(args).serving == serving
    err = capsys.readouterr().err
    if noted is None:
        assert err == ""
    else:
        assert noted in err and "GPU size" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, ["does not exist"]),
        ("{not json", ["is not JSON"]),
        ("[1, 2]", ["JSON object"]),
        (
            json.dumps({"text_config": {"hidden_size": 7168}}),
            ["lacks", "num_experts", "in text_config"],
        ),
        (json.dumps(LLAMA_CONFIG), ["is a llama model (model_type 'llama'), not Kimi"]),
        (
            json.dumps({**KIMI_K3_MOE_FIELDS, "num_experts": "896"}),
            ["num_experts", "'896'"],
        ),
        (
            json.dumps({"text_config": KIMI_K3_MOE_FIELDS}),
            ["lacks", "vocab_size", "linear_attn_config", "attention"],
        ),
        (
            json.dumps({"text_config": {**KIMI_K3_MOE_FIELDS, "moe_layer_freq": 0}}),
            ["moe_layer_freq", "at least 1", "got 0"],
        ),
        (
            json.dumps(
                {"text_config": {**KIMI_K3_TEXT_CONFIG, "dsa_config": {"topk": 8}}}
            ),
            ["dsa_config", "dsa_layers"],
        ),
    ],
    ids=[
        "missing",
        "not json",
        "not an object",
        "missing field",
        "another model",
        "field not int",
        "no attention fields",
        "layer frequency 0",
        "dsa_config without its layers",
    ],
)
def test_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys, content, words):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--config", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert str(path) in err
    for word in words:
        assert word in err


def test_a_directory_without_config_json(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--config", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"vllm-kimi-k3-moe plan: error: argument --config: {tmp_path} is a "
        "directory without a config.json"
    ]


def test_config_json_unreadable_is_one_line_without_errno(tmp_path, capsys):
    (tmp_path / "config.json").mkdir()  # a directory where the file should be
    with pytest.raises(SystemExit) as exited:
        main(["check", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Errno" not in err, err
    assert "cannot read config file" in err and "Is a directory" in err


def test_a_checkpoint_directory_is_read_as_its_config_json(tmp_path):
    config = json.dumps({"text_config": KIMI_K3_TEXT_CONFIG})
    (tmp_path / "config.json").write_text(config)
    inputs = [
        _plan_input(build_parser().parse_args(["plan", "--config", path]))
        for path in (str(tmp_path), str(tmp_path / "config.json"))
    ]
    assert inputs[0] == inputs[1]


def test_names_are_taken_in_any_case():
    given = ["--quantization", "W4A16", "--moe-backend", "MARLIN"]
    given += ["--kv-cache-dtype", "FP8", "--gpu", "H200", "--tp", "32"]
    asked = _plan_input(build_parser().parse_args(["plan", *given]))
    assert asked.quantization == "w4a16"
    assert asked.backend == "marlin"
    assert asked.serving.kv_cache_dtype == "fp8"
    assert asked.gpu_title == "H200 (150.1 GB)"


@pytest.fixture(scope="module")
def vllm_serve_parser():
    """vLLM's own ``EngineArgs`` options, as ``vllm serve`` reads them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
        a_cuda_platform_for_the_parser,
    )

    with a_cuda_platform_for_the_parser():
        return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("length", ["131072", "128k", "128K", "1.5m", " 25.6k "])
def test_max_model_len_reads_as_vllm_reads_it(vllm_serve_parser, length):
    args = build_parser().parse_args(["plan", "--tp", "8", "--max-model-len", length])
    by_vllm = vllm_serve_parser.parse_args(["--max-model-len", length])
    assert _plan_input(args).serving.max_model_len == by_vllm.max_model_len


@pytest.mark.parametrize(
    "length", ["131072x", "abc", "12 8k", "128kb", "1e5", "0x100", "", "128 K"]
)
def test_a_length_refused_before_vllm_is_refused_by_vllm(vllm_serve_parser, length):
    """What plan refuses before importing vLLM, vLLM's parser refuses too."""
    with pytest.raises(DeploymentError, match="not a length vLLM takes"):
        _refuse_non_lengths(length)
    with pytest.raises(SystemExit):
        vllm_serve_parser.parse_args(["--max-model-len", length])


@pytest.mark.parametrize(
    "length", ["1_000", "+5", " 12 ", "1.5m", "AUTO", "-1", "1.5K", "0", "25.6k"]
)
def test_what_vllm_reads_is_left_to_vllm(vllm_serve_parser, length):
    """What vLLM reads (or refuses in its own words) reaches vLLM's parser."""
    _refuse_non_lengths(length)


def test_a_length_typo_is_refused_without_importing_vllm():
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from vllm_kimi_k3_moe.tools.cli import main\n"
            "try:\n"
            "    main(['plan', '--gpus', '8', '--gpu', 'h200', '--max-model-len', "
            "'131072x'])\n"
            "finally:\n"
            "    print(sorted({'vllm', 'torch'} & set(sys.modules)))\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert imported.returncode == 2
    assert imported.stdout.strip() == "[]"
    assert "--max-model-len '131072x' is not a length" in imported.stderr


def test_console_script_is_installed_and_fails_fast():
    """The installed command: a bad topology is refused before vLLM is imported."""
    command = shutil.which("vllm-kimi-k3-moe")
    assert command is not None, "pip install the package: the console script"
    result = subprocess.run(
        [command, "plan", "--tp", "7"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [  # the heads are checked first
        "vllm-kimi-k3-moe plan: error: num_attention_heads 96 does not split evenly "
        "over tensor-parallel size 7; vLLM gives every rank the same whole heads; "
        "TP sizes that work: 1, 2, 4, 8, 16, 32"
    ]


def test_help_lists_the_backends():
    help_text = subprocess.run(
        [shutil.which("vllm-kimi-k3-moe") or "false", "plan", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for word in ("--gpus", "--gpu-memory-gib", "--moe-backend", "flashinfer_trtllm"):
        assert word in help_text


def test_docs_show_the_default_table_on_h20s(kimi_k3_deployment_plans):
    from pathlib import Path

    from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
    from vllm_kimi_k3_moe.tools.plan.report import serve_commands, table

    # docs/plan.md shows it on vLLM 0.34.0 and on 0.33.0
    readme = (Path(__file__).parents[3] / "docs" / "plan.md").read_text()
    plans = [kimi_k3_deployment_plans[tp] for tp in (8, 16, 32)]
    # plan --gpu h20: the table, then the command of each layout that fits
    shown = table(plans, gpu=gpu_preset("h20").title)
    assert f"{shown}\n{serve_commands(plans)}\n```" in readme


def test_every_offered_backend_is_vllms_and_sizes(plan):
    """Each name --moe-backend accepts is one of vLLM's --moe-backend values
    the layer builds with; at TP32 none allocates more than upstream's 256 or
    less than 96."""
    import typing

    from vllm.config.kernel import MoEBackend

    from vllm_kimi_k3_moe.formats import format_named

    for quantization in MXFP4_FORMATS:
        for backend in format_named(quantization).moe_backends:
            assert backend in typing.get_args(MoEBackend), backend
            deployment = Deployment(32, backend=backend, quantization=quantization)
            result = plan(deployment)
            assert result.upstream.intermediate_per_rank == 256, backend
            assert result.fixed.intermediate_per_rank in (96, 128), backend


def test_planning_leaves_vllms_kernel_checks_as_they_were(kimi_model):
    """The planner's stand-ins put back exactly what vLLM's classes held."""
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import (
        CutlassExpertsMxfp4,
    )
    from vllm.model_executor.layers.quantization import mxfp4

    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
        compressed_tensors_mxfp4_kernel,
    )

    before = dict(vars(CutlassExpertsMxfp4)), dict(vars(mxfp4))
    for backend in ("cutlass", "marlin"):
        with compressed_tensors_mxfp4_kernel(backend):
            pass
    assert dict(vars(CutlassExpertsMxfp4)) == before[0]
    assert dict(vars(mxfp4)) == before[1]


def test_default_sizes_that_do_not_build_are_left_out_and_said(kimi_model, capsys):
    """``--dp 64`` with the default TP8/16/32: TP32 x DP64 would split each
    expert's 3072 rows over 2048 GPUs, which vLLM refuses; TP8 and TP16 (6 and
    3 rows per GPU: whole MXFP4 blocks on the first GPUs) are sized."""
    assert main(["plan", "--dp", "64", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [d["deployment"]["tp_size"] for d in json.loads(out)] == [8, 16]
    assert "plan: left out TP32 DP64: moe_intermediate_size 3072" in err


def test_each_layout_that_fits_gets_its_serve_command(kimi_k3_deployment_plans):
    """plan --gpu h20: TP32 fits with the plugin only; its command is
    printed under the table, and TP8's and TP16's, which do not fit, are
    not, nor in --json."""
    from vllm_kimi_k3_moe.tools.plan.report import serve_commands

    plans = [kimi_k3_deployment_plans[tp] for tp in (8, 16, 32)]
    text = serve_commands(plans)
    assert [line.strip() for line in text.splitlines() if line.endswith(":")] == [
        "vllm serve (with the plugin installed), each layout that fits:",
        "TP32, 4 nodes of 8 GPUs, HEAD: node 0's address:",
        "node 0:",
        "node 1:",
    ]
    assert "vllm serve moonshotai/Kimi-K3 --tensor-parallel-size 32 " in text
    documents = [p.to_dict() for p in plans]
    assert [d["serve_command"] is not None for d in documents] == [False, False, True]
    assert [d["serve_commands"] is not None for d in documents] == [False, False, True]
    assert documents[2]["serve_command"] == plans[2].serve_command
    assert documents[2]["serve_commands"] == list(plans[2].serve_commands)


def test_without_a_gpu_size_no_command_is_vouched_for(kimi_k3_deployment_plans):
    from dataclasses import replace

    from vllm_kimi_k3_moe.tools.plan.report import serve_commands

    plan = replace(kimi_k3_deployment_plans[32], budget=None)
    assert plan.to_dict()["serve_command"] is None
    assert "given a GPU size (--gpu NAME" in serve_commands([plan])


@pytest.mark.parametrize(
    ("sized_after_warmup", "note"),
    [
        # vLLM 0.33: 206.0 GB of weights and the 6 GiB reserve (6.44 GB)
        # need 212.4 GB; vLLM takes 0.92 of the 95 GiB a CUDA process sees
        (False, "weights+reserve 212.4 > 93.8 GB"),
        # vLLM 0.34: the reserve is 12.5 GiB (13.42 GB: 2 of CUDA context,
        # 6 of activations, 4.5 of vLLM's margin); vLLM takes all 95 GiB
        (True, "weights+reserve 219.4 > 102.0 GB"),
    ],
)
def test_a_note_is_in_the_rows_unit(kimi_k3_deployment_plans, sized_after_warmup, note):
    """TP8 on H20s does not fit: the note says it in GB, as the weights
    columns, for the reserve and share of the vLLM installed."""
    plan = kimi_k3_deployment_plans[8]
    if plan.budget.after_warmup != sized_after_warmup:
        pytest.skip(f"not how {VLLM} sizes the KV cache")
    assert plan.reason() == note


@pytest.mark.parametrize(
    ("given", "noted"),
    [
        (["--quantization", "nvfp4"], True),  # its preset quantizes them
        (["--quantization", "fp8-block"], True),
        (["--quantization", "mxfp4"], False),  # the release's leaves them BF16
        (["--quantization", "w4a16"], False),
    ],
)
def test_plan_says_what_its_preset_assumes_of_the_adapters(given, noted, capsys):
    _plan_input(build_parser().parse_args(["plan", *given]))
    err = capsys.readouterr().err
    assert ("quantizes the latent adapters" in err) == noted, err


def test_a_config_of_its_own_is_sized_without_a_preset_note(tmp_path, capsys):
    config = {"text_config": KIMI_K3_TEXT_CONFIG}
    config["quantization_config"] = QUANTIZATION_CONFIGS["nvfp4"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    _plan_input(build_parser().parse_args(["plan", "--config", str(tmp_path)]))
    assert "preset" not in capsys.readouterr().err


def test_a_shorter_max_model_len_holds_more_requests_and_fewer_tokens(
    kimi_k3_deployment_plans,
):
    """What the tables' note says, as vLLM's own planner sizes it (TP32 on
    H20s): each request's KDA state is paid whatever its length."""
    from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
    from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
    from vllm_kimi_k3_moe.tools.plan.planner import Planner

    long = kimi_k3_deployment_plans[32].fixed_kv
    budget = GpuBudget(gpu_preset("h20").memory_gib)
    serving = Serving(max_model_len=10_000)
    with Planner(KIMI_K3_TEXT_CONFIG, serving, budget) as planner:
        short = planner.plan(Deployment(32)).fixed_kv
    assert short.concurrency > long.concurrency
    assert short.tokens < long.tokens


def test_the_gpu_given_by_its_memory_is_named_in_the_headings_unit() -> None:
    """The advisor's heading counts in GB (10^9 bytes): 80 GiB is 85.9 GB."""
    args = build_parser().parse_args(["plan", "--gpu-memory-gib", "80", "--tp", "8"])
    assert _plan_input(args).gpu_title.startswith("85.9 GB ")
