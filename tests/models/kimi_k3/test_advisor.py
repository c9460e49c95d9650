"""``plan``'s answer to "on N GPUs of this kind, how do I serve Kimi-K3": every
layout vLLM builds, pipeline stages and data-parallel replicas sized as real
builds of them size, the vision tower counted as ``vllm serve`` loads it, and
a ``vllm serve`` command vLLM's own parser reads back as the layout."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from tests.models.kimi_k3.conftest import sized_for
from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
from vllm_kimi_k3_moe.tools.deployment.text_config import KIMI_K3_TEXT_CONFIG
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    Serving,
    Topology,
    layouts,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import a_cuda_platform_for_the_parser
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank
from vllm_kimi_k3_moe.tools.plan.planner import Planner

H200 = GpuBudget(gpu_preset("h200").memory_gib)
LAYERS = 93
# MoonViT (27 blocks of 1024, vLLM's KimiK3VisionConfig defaults, which the
# release's vision_config equals) and its projector to 7168, in bf16: 802.4 MB
# of tower and 92.3 MB of projector, replicated on every GPU of the first
# stage (12 heads do not split over TP8 and up).
VISION_TOWER_BYTES = 447_358_976 * 2


@pytest.fixture(scope="module")
def planner(kimi_k3_planner):
    """A planner of Kimi-K3 on H200s (vLLM's defaults otherwise), on the
    session's builds (``kimi_k3_planner``)."""
    return sized_for(kimi_k3_planner, H200)


def real_build(planner, deployment: Deployment, pp_rank: int = 0):
    """vLLM's model for rank 0 of ``deployment``'s stage ``pp_rank``, built
    as it is (pipeline and data parallelism included), not derived."""
    with tempfile.TemporaryDirectory() as directory:
        model_dir = write_model_dir(
            KIMI_K3_TEXT_CONFIG,
            mxfp4.RELEASE.published_quantization_config(),
            Serving(),
            Path(directory),
        )
        return build_rank(
            planner.fixed_cls,
            KIMI_K3_TEXT_CONFIG,
            deployment,
            Serving(),
            model_dir,
            pp_rank,
        )


@pytest.mark.parametrize(
    "deployment",
    [Deployment(8, pp_size=2), Deployment(4, pp_size=3, dp_size=2)],
    ids=["TP8 PP2", "TP4 PP3 DP2"],
)
def test_each_pipeline_stage_is_what_a_pipeline_build_allocates(planner, deployment):
    plan = planner.plan(deployment)
    assert plan.stages[0].layers[0] == 0
    assert plan.stages[-1].layers[1] == LAYERS
    for stage in (plan.stages[0], plan.stages[-1]):
        built = real_build(planner, deployment, stage.index)
        assert built.allocation.components == stage.fixed.components, stage.index
    # the vision tower and the embeddings live on the first stage only
    assert plan.stages[0].fixed.components["vision_tower"] > 0
    assert plan.stages[-1].fixed.components["vision_tower"] == 0
    assert plan.stages[-1].fixed.components["embeddings"] == 0
    assert plan.stages[-1].fixed.components["lm_head"] > 0


@pytest.mark.parametrize(
    "deployment",
    [
        Deployment(8, dp_size=2, expert_parallel=True),
        Deployment(8, dp_size=4),
        Deployment(32, expert_parallel=True),
    ],
    ids=["TP8 DP2 EP", "TP8 DP4", "TP32 EP"],
)
def test_data_parallel_layouts_are_what_their_own_build_allocates(planner, deployment):
    """The planner builds the whole model once per TP and the MLPs alone per
    DP size and expert parallelism; a build of the whole deployment agrees
    byte for byte."""
    (stage,) = planner.plan(deployment).stages
    assert real_build(planner, deployment).allocation.components == (
        stage.fixed.components
    )


def test_the_vision_tower_is_counted_unless_language_model_only(kimi_k3_planner):
    deployment = Deployment(32)
    with_vision = kimi_k3_planner.plan(deployment)
    with Planner(KIMI_K3_TEXT_CONFIG, Serving(language_model_only=True)) as planner:
        without = planner.plan(deployment)
    assert with_vision.fixed.components["vision_tower"] == VISION_TOWER_BYTES
    assert without.fixed.components["vision_tower"] == 0
    assert with_vision.fixed.total_bytes - without.fixed.total_bytes == (
        VISION_TOWER_BYTES
    )
    assert "--language-model-only" in without.serve_command
    assert "--language-model-only" not in with_vision.serve_command


@pytest.fixture(scope="module")
def advice_16(planner):
    return planner.advise(16, "mxfp4", "marlin")


def test_the_advisor_lists_every_layout_vllm_builds(advice_16):
    plans, refused = advice_16
    assert refused == []
    listed = {replace(p.deployment, backend="", quantization="") for p in plans}
    expected = layouts(16, KIMI_K3_TEXT_CONFIG)
    assert {
        Deployment(
            t.tp_size,
            dp_size=t.dp_size,
            pp_size=t.pp_size,
            expert_parallel=t.expert_parallel,
            dcp_size=t.dcp_size,
            backend="",
            quantization="",
        )
        for t in expected
    } == listed
    assert all(p.deployment.gpus == 16 for p in plans)
    # vLLM's recipe layouts are among them: TP8 x PP2, TP16 with EP, TP8 x DP2
    labels = {p.deployment.label() for p in plans}
    assert {"TP8 PP2", "TP16 EP", "TP8 DP2"} <= labels
    # and every DCP size dividing TP, each once: TP16 with DCP 2, 4, 8, 16
    assert len(plans) == len(labels)
    assert {"TP8 DCP8 PP2", *(f"TP16 DCP{n}" for n in (2, 4, 8, 16))} <= labels
    assert "TP16 DCP3" not in labels


def test_fitting_layouts_come_first_then_by_kv_tokens(advice_16):
    plans, _ = advice_16
    fits = [bool(p.fits("fixed")) for p in plans]
    assert fits == sorted(fits, reverse=True) and fits[0]
    tokens = [p.fixed_kv.tokens for p in plans if p.fits("fixed")]
    assert tokens == sorted(tokens, reverse=True)
    for p in plans:
        assert (p.reason() is None) == bool(p.fits("fixed")), p.deployment.label()


def test_dcp_sizes_between_hold_kv_cache_between(advice_16):
    """What lets the table show only DCP 1 and DCP = TP of each layout: the
    same weights, and the KV tokens of every DCP size in between lie
    between those two rows'."""
    plans, _ = advice_16
    by_layout: dict = {}
    for p in plans:
        by_layout.setdefault(replace(p.deployment, dcp_size=1), []).append(p)
    between = 0
    for group in by_layout.values():
        group.sort(key=lambda p: p.deployment.dcp_size)
        weights = {p.fixed.total_bytes for p in group}
        tokens = [p.fixed_kv.tokens for p in group]
        assert len(weights) == 1 and tokens == sorted(tokens)
        between += len(group) - 2 if len(group) > 2 else 0
    assert between > 0


def serve_arguments(command: str):
    """``command`` (``vllm serve MODEL ...``) read by vLLM's own parser (the
    options ``EngineArgs`` takes, which ``vllm serve`` adds to its own)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"]
    with a_cuda_platform_for_the_parser():
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return parser.parse_args(["--model", *words[2:]])


@pytest.mark.parametrize(
    ("deployment", "serving"),
    [
        (Deployment(32, expert_parallel=True), Serving()),
        (Deployment(8, pp_size=2, dcp_size=8), Serving("fp8", 32768)),
        (
            Deployment(4, pp_size=2, dp_size=2, expert_parallel=True),
            Serving(language_model_only=True),
        ),
    ],
)
def test_the_serve_command_parses_to_the_layout(kimi_model, deployment, serving):
    from vllm.engine.arg_utils import EngineArgs

    with Planner(KIMI_K3_TEXT_CONFIG, serving, H200, "/models/Kimi-K3") as planner:
        plan = planner.plan(deployment)
    args = serve_arguments(plan.serve_command)
    assert args.model == "/models/Kimi-K3"
    assert args.tensor_parallel_size == deployment.tp_size
    assert args.pipeline_parallel_size == deployment.pp_size
    assert args.decode_context_parallel_size == deployment.dcp_size
    assert args.data_parallel_size == deployment.dp_size
    assert args.enable_expert_parallel == deployment.expert_parallel
    assert args.moe_backend == deployment.backend
    assert args.kv_cache_dtype == serving.kv_cache_dtype
    assert args.max_model_len == serving.max_model_len
    # not pinned: vLLM's own default, which plan sized with (test_kv_budget)
    assert "--gpu-memory-utilization" not in plan.serve_command
    assert args.gpu_memory_utilization == EngineArgs.gpu_memory_utilization
    assert args.language_model_only == serving.language_model_only


def test_advisor_json_has_one_entry_per_layout(kimi_model, capsys):
    """Each layout's figures; where none fits (8 B200s), no next step is
    sized: the table's last lines, which --json does not print."""
    assert main(["plan", "--gpus", "8", "--gpu", "b200", "--json"]) == 0
    printed = capsys.readouterr()
    documents = json.loads(printed.out)
    assert documents
    assert not any(document["fits"]["fixed"] for document in documents)
    assert "sizing more GPUs" not in printed.err
    for document in documents:
        deployment = document["deployment"]
        assert deployment["gpus"] == 8 and "pp_size" in deployment
        assert set(document["fits"]) >= {"upstream", "fixed"}
        assert (document["reason"] is None) == document["fits"]["fixed"]
        if document["fits"]["fixed"]:
            assert document["serve_command"].startswith("vllm serve ")
        else:  # no command for a layout that does not fit
            assert document["serve_command"] is None
        if deployment["pp_size"] > 1:
            stages = document["stages"]
            assert len(stages) == deployment["pp_size"]
            heaviest = max(stage["fixed_bytes"] for stage in stages)
            assert document["whole_model"]["fixed_bytes"] == heaviest


@pytest.mark.slow
def test_advisor_in_a_fresh_process_prints_one_screen_and_no_noise():
    """``python -m vllm_kimi_k3_moe``: the table within 120 columns, and on
    stderr only the command's own progress line (importing vLLM on a machine
    without a GPU prints lines that are harmless here)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_kimi_k3_moe",
            "plan",
            "--gpus",
            "8",
            "--gpu",
            "b300",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[3],  # this tree's package
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert max(len(line) for line in out.splitlines()) <= 120
    assert result.stderr.splitlines() == [
        "importing vLLM and building its Kimi-K3 model ..."
    ]
    # it says what it orders by, and marks what vLLM's recipe runs on B300s
    # (TP8, with DCP8 opt-in) beside the layouts with the most KV cache
    assert "most KV cache first" in out.splitlines()[1] and "best" not in out
    marked = [line.split("*")[0].strip() for line in out.splitlines() if " * " in line]
    assert marked == ["TP8 DCP8", "TP8"]
    # their serve commands, among the first few (most KV cache) or after
    # them (which, depends on the KV cache the installed vLLM leaves)
    commands = out[out.index("vllm serve (with the plugin installed)") :]
    assert "\n  TP8 DCP8:\n" in commands and "\n  TP8:\n" in commands
    assert "--decode-context-parallel-size 8" in commands
    # each layout without DCP and with DCP = TP; the sizes between in --json
    rows = {line.split(" *")[0].split("  ")[0] for line in out.splitlines()}
    assert {"TP8", "TP8 DCP8", "TP4 DCP4 PP2"} <= rows
    assert not {"TP8 DCP4", "TP8 DCP2", "TP4 DCP2 PP2"} & rows
    assert "Not in the table: 8 layouts with DCP between 1 and their TP" in out


@pytest.fixture
def plan_on_the_module_planner(planner, monkeypatch):
    """``plan`` on 141 GiB H200s (vLLM's defaults otherwise) sizing with the
    module's planner, whose builds it shares, instead of a new one."""
    from vllm_kimi_k3_moe.tools.plan import answers

    monkeypatch.setattr(planner, "close", lambda: None)
    monkeypatch.setattr(answers, "Planner", lambda *_, **__: planner)


def test_the_advisor_says_how_to_get_any_layouts_command(
    plan_on_the_module_planner, advice_16, monkeypatch, capsys
):
    """16 x H200 (with the public layouts taken away, as for a GPU no public
    deployment states one for): the advisor says why nothing is marked and
    prints the plan command of a layout whose serve command it does not
    show; that command sizes that layout alone and prints its serve line."""
    from vllm_kimi_k3_moe.tools.cli import plan as plan_command

    monkeypatch.setattr(plan_command, "public_layouts", lambda *_: ())
    assert main(["plan", "--gpus", "16", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "No row is marked *: no public deployment of Kimi-K3 on 16 x H200" in out
    assert " * " not in out
    head, pick = out.split("Any layout's command alone, for example ")[1].split("\n")[
        :2
    ]
    label = head.split("'s:")[0]
    words = shlex.split(pick)
    assert words[:4] == ["vllm-kimi-k3-moe", "plan", "--gpu", "h200"]
    shown = out.split("vllm serve (with the plugin installed)")[1].split("Any ")[0]
    assert f"  {label}:" not in shown  # a layout whose command was not shown
    assert main(words[1:]) == 0
    alone = capsys.readouterr().out
    assert f"\n{label} " in alone  # its row
    printed = alone.split(f"\n  {label}")[1].split(":\n", 1)[1]
    if printed.lstrip().startswith("node 0:"):  # over nodes: node 0's line
        printed = printed.split("node 0:\n")[1].split("node 1:")[0]
    (advised,) = [p for p in advice_16[0] if p.deployment.label() == label]
    assert " ".join(printed.replace("\\\n", " ").split()) == advised.advised_command


def test_each_public_layout_says_whether_it_fits_and_how_it_is_run(advice_16):
    """16 x H200: the recipe's TP8 DP2 is marked and does not fit at plan's
    defaults; the advisor says so with its row's reason, and the flags the
    recipe runs it with, in the plan command that sizes it there."""
    from vllm_kimi_k3_moe.tools.plan.public_layouts import public_layouts
    from vllm_kimi_k3_moe.tools.plan.report import advice

    plans, refused = advice_16
    public = public_layouts("h200", 16)
    out = advice(plans, refused, "16 x H200", public, "", lambda t: f"plan {t}")
    public_part = out.split("* run in public")[1].split("Not in the table")[0]
    said = " ".join(public_part.split())
    (dp2,) = [p for p in plans if p.deployment.label() == "TP8 DP2"]
    (pp2,) = [p for p in plans if p.deployment.label() == "TP8 PP2"]
    assert pp2.fits("fixed") and not dp2.fits("fixed")
    assert "TP8 PP2: fits at plan's defaults" in said
    assert f"TP8 DP2: does not fit at plan's defaults ({dp2.reason()})" in said
    assert (
        "vLLM's recipe runs it with --gpu-memory-utilization 0.97 --max-model-len "
        "32768 sized so: plan " in said
    )


def test_the_table_defines_its_kv_columns(advice_16):
    """requests and KV tokens are defined under the table, with why a
    shorter --max-model-len lowers KV tokens."""
    from vllm_kimi_k3_moe.tools.plan.report import table

    said = " ".join(table(advice_16[0][:3]).split())
    assert "requests: how many requests of --max-model-len (131072) tokens" in said
    assert "KV tokens: requests x --max-model-len" in said
    assert "a shorter --max-model-len holds more requests and fewer KV tokens" in said


def test_a_layouts_plan_command_carries_every_option_the_advisor_was_given():
    """The command the advisor prints for one layout, read back by plan's
    own parser, asks for what the advisor was asked (but ``--gpus``, and
    the layout it names): the same draft, nodes, quantization and
    everything else, so it sizes that layout as the advisor did."""
    from vllm_kimi_k3_moe.tools.cli import build_parser
    from vllm_kimi_k3_moe.tools.cli.plan import plan_command

    parser = build_parser()
    asked = parser.parse_args(
        [
            *("plan", "--gpus", "32", "--gpu", "h200", "--gpus-per-node", "4"),
            *("--quantization", "online"),
            *("--quantization-config", '{"moe": "fp8_per_block"}'),
            *("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'),
            *("--kv-cache-dtype", "fp8", "--max-model-len", "65536"),
            *("--gpu-memory-utilization", "0.85", "--reserve-gib", "10"),
            *("--model", "moonshotai/Kimi-K3", "--language-model-only"),
        ]
    )
    words = shlex.split(plan_command(asked, Topology(8, pp_size=4)))
    again = parser.parse_args(words[1:])
    layout = {"gpus", "tp_sizes", "pp_size"}
    given = {k: v for k, v in vars(asked).items() if k not in layout}
    assert {k: v for k, v in vars(again).items() if k not in layout} == given
    assert (again.tp_sizes, again.pp_size, again.gpus) == ([8], 4, None)
