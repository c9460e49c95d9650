"""``plan --speculative-config``: vLLM builds the draft (DSpark, Kimi-K3's MTP)
from its config and loads it as its model runner does; what it adds to a GPU
is counted, its KV cache grouped with the target's by vLLM's planner, and the
serve lines carry the spec. What cannot be sized is one line before vLLM."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.gpus import gpu_preset
from vllm_kimi_k3_moe.tools.deployment.speculation import read_speculative_config
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    one_layer_of_each,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.draft import for_vllm, write_draft_dir
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank
from vllm_kimi_k3_moe.tools.plan.planner import Planner

DSPARK = {"method": "dspark", "model": "Inferact/Kimi-K3-DSpark"}
DSPARK_7 = {**DSPARK, "num_speculative_tokens": 7}  # vLLM's recipe
VOCAB, HIDDEN = 163840, 7168
# Published for the draft: 3.56 B parameters in its checkpoint, whose
# embedding vLLM shares with the target (the model cards' 3,562,312,961).
DSPARK_CHECKPOINT_PARAMETERS = 3_562_312_961
MLA_LAYERS, DRAFT_LAYERS, KDA_LAYERS = 24, 5, 69


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("{method: dspark}", ["not JSON"]),
        ('["dspark"]', ["must be a JSON object"]),
        ('{"method": "eagle3", "model": "x"}', ["method 'eagle3'", "dspark"]),
        ('{"method": "dspark"}', ["needs its draft", "Inferact/Kimi-K3-DSpark"]),
        (
            '{"method": "dspark", "model": "someone/Kimi-K3-DSpark-v9"}',
            ["neither a directory nor a public draft", "hf download"],
        ),
        (
            '{"method": "dspark", "model": "RedHatAI/Kimi-K3-speculator.dspark"}',
            ["no public copy of its config.json", "hf download RedHatAI"],
        ),
        # the released config has no MTP layer (vLLM divides by their count)
        ('{"method": "mtp", "num_speculative_tokens": 1}', ["num_nextn_predict"]),
    ],
)
def test_what_cannot_be_sized_is_one_line_before_vllm(capsys, spec, words):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--tp", "8", "--speculative-config", spec])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vllm-kimi-k3-moe plan: error: ")
    for word in words:
        assert word in err[0]


def test_a_local_draft_directory_is_its_config(tmp_path, capsys):
    """A draft named by directory is sized from its own ``config.json``; a
    directory without one is refused in one line."""
    draft = tmp_path / "draft"
    draft.mkdir()
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7}
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--tp", "8", "--speculative-config", json.dumps(spec)])
    assert exited.value.code == 2
    assert "cannot read its config.json" in capsys.readouterr().err
    (draft / "config.json").write_text(json.dumps({"model_type": "k3_dspark"}))
    speculation = read_speculative_config(json.dumps(spec), KIMI_K3_TEXT_CONFIG)
    assert speculation.draft_config == {"model_type": "k3_dspark"}
    assert speculation.spec == spec  # the serve lines carry it as given


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A two-layer Kimi-K3 (one dense, one MoE layer, one MTP layer) and its
    weightless directory, in the released MXFP4."""
    text_config = {
        **one_layer_of_each(KIMI_K3_TEXT_CONFIG),
        "num_nextn_predict_layers": 1,
    }
    directory = tmp_path_factory.mktemp("two-layers")
    write_model_dir(
        text_config,
        mxfp4.RELEASE.published_quantization_config(),
        Serving(language_model_only=True),
        directory,
    )
    return text_config, directory


def draft_build(planner, text_config, model_dir, spec, deployment, cls):
    speculation = read_speculative_config(json.dumps(spec), text_config)
    with tempfile.TemporaryDirectory() as directory:
        speculative = for_vllm(
            speculation, write_draft_dir(speculation, Path(directory))
        )
        return build_rank(
            cls,
            text_config,
            deployment,
            Serving(language_model_only=True),
            model_dir,
            speculative=speculative,
        )


def test_the_public_dspark_draft_is_the_published_one(kimi_model, two_layers):
    """vLLM builds the kept Inferact config as its K3 DSpark draft (TP1):
    its own parameters, less the copy of the layers' KV projections it
    fuses (``context_kv_proj``, loaded from the same checkpoint tensors),
    with the embedding it shares with the target, are the 3.56 B published."""
    text_config, model_dir = two_layers
    from vllm_kimi_k3_moe.tools.meta_rank.draft import own_parameters
    from vllm_kimi_k3_moe.tools.plan.planner import kimi_moe_classes

    _, fixed = kimi_moe_classes()
    built = draft_build(None, text_config, model_dir, DSPARK_7, Deployment(1), fixed)
    assert type(built.draft).__name__ == "K3DSparkForCausalLM"
    own = dict(own_parameters(built.draft, built.model))
    assert built.allocation.components["speculative_draft"] == sum(
        p.numel() * p.element_size() for p in own.values()
    )
    fused = own.pop("model.context_kv_proj.weight").numel()
    assert fused == DRAFT_LAYERS * (512 + 64) * HIDDEN  # kv_lora_rank + rope
    parameters = sum(p.numel() for p in own.values())
    assert parameters + VOCAB * HIDDEN == DSPARK_CHECKPOINT_PARAMETERS


def test_the_mtp_draft_moe_layer_is_the_plugins(kimi_model, two_layers):
    """Kimi-K3's MTP draft is a decoder layer with its own ``KimiMoE``: at
    TP32 the plugin gives its experts 128 rows as in every other layer,
    vLLM alone 256; the draft's bytes differ by the MoE layer's."""
    text_config, model_dir = two_layers
    from vllm_kimi_k3_moe.tools.plan.planner import kimi_moe_classes

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    builds = {
        side: draft_build(None, text_config, model_dir, spec, Deployment(32), cls)
        for side, cls in zip(("upstream", "fixed"), kimi_moe_classes(), strict=True)
    }
    drafts = {
        s: b.allocation.components["speculative_draft"] for s, b in builds.items()
    }
    assert builds["fixed"].moe_layer.intermediate_per_rank == 128
    assert builds["upstream"].moe_layer.intermediate_per_rank == 256
    routed = {s: b.moe_layer.routed_bytes for s, b in builds.items()}
    assert (
        drafts["upstream"] - drafts["fixed"] == routed["upstream"] - routed["fixed"] > 0
    )


@pytest.fixture(scope="module")
def dspark_on_b300(kimi_model):
    budget = GpuBudget(gpu_preset("b300").memory_gib)
    speculation = read_speculative_config(json.dumps(DSPARK_7), KIMI_K3_TEXT_CONFIG)
    with Planner(
        KIMI_K3_TEXT_CONFIG, budget=budget, speculation=speculation
    ) as planner:
        yield planner


def test_dspark_at_tp8_on_b300(dspark_on_b300, kimi_k3_deployment_plans):
    """TP8 with vLLM's recipe draft: the target's weights and the draft's,
    the draft's 5 MLA layers in vLLM's KV-cache groups, which vLLM pads with
    18 layers instead of 3 (vllm-ascend issue #14314 measured the same 3 ->
    18 of 69 KDA layers, 4.35 % -> 26.09 %), and the spec on the serve line."""
    plan = dspark_on_b300.plan(Deployment(8))
    alone = kimi_k3_deployment_plans[8]  # the target alone
    draft = plan.fixed.components["speculative_draft"]
    assert draft > 1e9
    assert plan.fixed.total_bytes == alone.fixed.total_bytes + draft
    assert plan.upstream.total_bytes == alone.upstream.total_bytes + draft
    kv, kv_alone = plan.kv_cache, alone.kv_cache
    assert (kv.mla_layers, kv_alone.mla_layers) == (MLA_LAYERS + DRAFT_LAYERS, 24)
    assert kv.kda_layers == kv_alone.kda_layers == KDA_LAYERS
    assert kv.mla_bytes_per_token == kv_alone.mla_bytes_per_token * 29 // 24
    assert (kv.padding_layers, kv_alone.padding_layers) == (18, 3)
    assert plan.fits("fixed")
    assert json.dumps(DSPARK_7) in plan.serve_command
    assert not any("draft" in item for item in plan.not_counted)


def test_the_draft_is_on_the_last_pipeline_stage(dspark_on_b300):
    """vLLM 0.33.0 builds the drafter on the last stage (its draft parallel
    config has one stage), with its KV cache."""
    stages = dspark_on_b300.plan(Deployment(8, pp_size=2)).stages
    drafts = [stage.fixed.components["speculative_draft"] for stage in stages]
    assert drafts[0] == 0 and drafts[1] > 1e9
    one_stage = dspark_on_b300.plan(Deployment(8)).fixed.components
    assert drafts[1] == one_stage["speculative_draft"]
    plan = dspark_on_b300.plan(replace(Deployment(8), pp_size=2))
    assert plan.fixed_kv is not None and plan.fixed_kv.tokens > 0


def test_the_kv_cache_is_vllms_for_every_layer_the_build_registered(dspark_on_b300):
    """What the planner gives for an amount of memory is what vLLM's
    block-pool planner makes of every attention layer the target and the
    draft registered in the forward context (the draft's five included)."""
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
    )
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    plan = dspark_on_b300.plan(Deployment(8))
    memory = plan.fixed_kv.available_bytes
    config = dspark_on_b300._built(Deployment(8)).kv.vllm_config
    specs = get_kv_cache_spec(config)
    assert len(specs) == MLA_LAYERS + DRAFT_LAYERS + KDA_LAYERS
    groups = get_global_kv_cache_groups(config, [specs])
    configs = get_kv_cache_configs(config, [specs], [memory], groups)
    tokens, _ = get_kv_cache_capacity(
        config, generate_scheduler_kv_cache_config(configs)
    )
    assert plan.fixed_kv.tokens == tokens
