"""``plan`` on an AMD GPU builds vLLM's AMD Kimi-K3 whole, as ROCm builds it:
the MLA layers on the backend vLLM's ROCm selector picks for the GPU's
architecture and AITER setting (their KV-cache blocks that backend's), the
KDA layers vLLM's ROCm ones, the draft vLLM's AMD MTP model; DCP layouts
are those vLLM's selector takes (``use_dcp``), and the stderr note says
what is still not known here.

Why: the tools built vLLM's NVIDIA model with only the MoE layers AMD's,
so attention, its backend, the KV-cache blocks and the KDA state were
NVIDIA's (FlashKDA's prefill checkpoint block, which vLLM's ROCm KDA layer
keeps only with a kernel of vLLM's gfx950 build). Everything asserted here
is what vLLM's own classes answer under the ROCm stand-ins (architecture,
AITER switches, compiled ops); the builds are two-layer models (one KDA,
one MLA layer), a fraction of a second each after the first import.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_kimi_k3_moe.formats import mxfp4
from vllm_kimi_k3_moe.tools.cli import plan as plan_cli
from vllm_kimi_k3_moe.tools.deployment.gpus import AITER_VARIABLE, an_amd_gpu_named
from vllm_kimi_k3_moe.tools.deployment.speculation import read_speculative_config
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    one_layer_of_each,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Serving
from vllm_kimi_k3_moe.tools.meta_rank.draft import for_vllm, write_draft_dir
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank
from vllm_kimi_k3_moe.tools.plan.planner import PlanError, Planner, kimi_moe_classes

TWO_LAYERS = one_layer_of_each(KIMI_K3_TEXT_CONFIG)  # a KDA and an MLA layer
# (architecture, AITER on) -> the --moe-backend vLLM selects there
GPUS = {("gfx942", False): "emulation", ("gfx950", True): "aiter"}


@pytest.fixture(autouse=True)
def recipe_aiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """AITER's switch unset: vLLM's own default for everything it reads."""
    monkeypatch.delenv(AITER_VARIABLE, raising=False)


@pytest.fixture(scope="module")
def rocm_planners(kimi_model):
    """A ``Planner`` of the two-layer model per AMD GPU kind; entered in
    ``an_amd_gpu_named`` by each use (``on``)."""
    planners = {}
    for gpu in GPUS:
        with an_amd_gpu_named(*gpu):
            planners[gpu] = Planner(TWO_LAYERS, Serving(language_model_only=True))
    yield planners
    for planner in planners.values():
        planner.close()


def built(planners, gpu, tp=8, **deployment):
    with an_amd_gpu_named(*gpu):
        return planners[gpu]._built(Deployment(tp, backend=GPUS[gpu], **deployment))


def planned(planners, gpu, **deployment):
    with an_amd_gpu_named(*gpu):
        return planners[gpu].plan(Deployment(8, backend=GPUS[gpu], **deployment))


@pytest.mark.parametrize(
    ("gpu", "mla_backend"),
    [(("gfx942", False), "TRITON_MLA"), (("gfx950", True), "ROCM_AITER_MLA")],
    ids=["cdna3", "cdna4-aiter"],
)
def test_the_model_is_vllms_amd_one_on_the_backend_rocm_selects(
    rocm_planners, gpu, mla_backend
) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    kv = built(rocm_planners, gpu).kv
    layers = kv.vllm_config.compilation_config.static_forward_context
    kinds = {type(layers[name]).__module__: layers[name] for name in kv.specs}
    assert set(kinds) == {
        "vllm.models.kimi_k3.amd.kda",  # vLLM's ROCm KDA layer
        "vllm.model_executor.layers.attention.mla_attention",  # AMD's MLA
    }
    assert kv.shape.rocm_mla_backend == mla_backend
    mla = kinds["vllm.model_executor.layers.attention.mla_attention"]
    assert issubclass(
        mla.get_attn_backend(), AttentionBackendEnum[mla_backend].get_class()
    )
    # the KDA state a request holds is the ROCm layer's: no prefill
    # checkpoint block (FlashKDA's, on NVIDIA GPUs, keeps one)
    (kda_spec,) = [s for s in kv.specs.values() if isinstance(s, MambaSpec)]
    assert kda_spec.num_prefill_checkpoint_blocks == 0


def test_the_fused_kda_chunk_build_option_is_known_only_on_cdna4(
    rocm_planners,
) -> None:
    """vLLM's ROCm KDA layer would keep a prefill-checkpoint block with its
    fused KDA chunk kernel, which only vLLM's gfx950 build can have."""
    from vllm.v1.kv_cache_interface import MambaSpec

    assert not built(rocm_planners, ("gfx942", False)).kv.shape.kda_checkpoint_if_fused
    assert built(rocm_planners, ("gfx950", True)).kv.shape.kda_checkpoint_if_fused
    # asking leaves vLLM's cached answer as this machine's: a build after it
    # resolves the KDA prefill kernel as the first did (no checkpoint block)
    later = built(rocm_planners, ("gfx950", True), tp=4).kv.specs.values()
    (kda,) = [spec for spec in later if isinstance(spec, MambaSpec)]
    assert kda.num_prefill_checkpoint_blocks == 0


def test_dcp_is_what_vllms_rocm_selector_takes(rocm_planners, monkeypatch) -> None:
    """Both ROCm MLA backends take DCP (``supports_dcp``); where the one the
    build used did not, the selector's other pick is not sized; where none
    does, vLLM's own refusal is the layout's."""
    from vllm.v1.attention.backends.mla import rocm_aiter_mla, triton_mla

    gpu = ("gfx950", True)
    assert planned(rocm_planners, gpu, dcp_size=8).kv_cache.dcp_size == 8
    built(rocm_planners, gpu).kv._by_dcp.clear()  # asked again below
    monkeypatch.setattr(rocm_aiter_mla.AiterMLAImpl, "supports_dcp", False)
    with pytest.raises(PlanError, match="picks TRITON_MLA under DCP 4"):
        planned(rocm_planners, gpu, dcp_size=4)
    monkeypatch.setattr(triton_mla.TritonMLAImpl, "supports_dcp", False)
    with pytest.raises(PlanError, match=r"refuses DCP 2.*DCP not supported"):
        planned(rocm_planners, gpu, dcp_size=2)


def test_vllms_amd_model_builds_a_pipeline_stage(kimi_model, tmp_path) -> None:
    """PP layouts plan lists on ROCm build there: vLLM's ROCm platform has no
    pipeline rule of its own, and its AMD model builds the last stage of
    TP4 PP2 (the layer it holds, the others missing)."""
    model_dir = write_model_dir(
        TWO_LAYERS,
        mxfp4.RELEASE.published_quantization_config(),
        Serving(language_model_only=True),
        tmp_path,
    )
    with an_amd_gpu_named("gfx950", True):
        rank = build_rank(
            kimi_moe_classes()[1],
            TWO_LAYERS,
            Deployment(4, pp_size=2, backend="aiter"),
            Serving(language_model_only=True),
            model_dir,
            pp_rank=1,
        )
    language_model = rank.model.language_model.model
    assert type(rank.model).__module__ == "vllm.models.kimi_k3.amd.model"
    assert (language_model.start_layer, language_model.end_layer) == (1, 2)


# The draft's MLA backends as vLLM's ROCm selector takes them on CDNA4 with
# AITER on: DSpark's non-causal decode takes AITER MLA only where the AITER
# build has its non-causal decode kernels (asked of the library, absent
# here), else Triton MLA; both are ROCm's, with the same KV-cache blocks.
ROCM_MLA = {"ROCM_AITER_MLA", "TRITON_MLA"}


@pytest.mark.parametrize(
    ("spec", "module", "backends"),
    [
        (
            {"method": "mtp", "num_speculative_tokens": 1},
            "amd.mtp",
            {"ROCM_AITER_MLA"},
        ),
        (  # vLLM's DSpark model is one for every platform
            {
                "method": "dspark",
                "model": "Inferact/Kimi-K3-DSpark",
                "num_speculative_tokens": 7,
            },
            "nvidia.dspark_mla",
            ROCM_MLA,
        ),
    ],
    ids=["mtp", "dspark"],
)
def test_the_draft_is_the_one_vllm_builds_on_rocm(
    kimi_model, tmp_path, spec, module, backends
) -> None:
    """The draft is built as on ROCm: vLLM's AMD MTP model, or its DSpark
    model with its MLA layers on the backend ROCm's selector picks."""
    text_config = {**TWO_LAYERS, "num_nextn_predict_layers": 1}
    model_dir = write_model_dir(
        text_config,
        mxfp4.RELEASE.published_quantization_config(),
        Serving(language_model_only=True),
        tmp_path,
    )
    speculation = read_speculative_config(json.dumps(spec), text_config)
    with tempfile.TemporaryDirectory() as directory, an_amd_gpu_named("gfx950", True):
        speculative = for_vllm(
            speculation, write_draft_dir(speculation, Path(directory))
        )
        rank = build_rank(
            kimi_moe_classes()[1],
            text_config,
            Deployment(8, backend="aiter"),
            Serving(language_model_only=True),
            model_dir,
            speculative=speculative,
        )
    assert type(rank.draft).__module__ == f"vllm.models.kimi_k3.{module}"
    layers = rank.vllm_config.compilation_config.static_forward_context
    # the draft's attention layers: numbered after the target's
    drafted = [
        layer.get_attn_backend().get_name()
        for name, layer in layers.items()
        if hasattr(layer, "get_attn_backend")
        and int(re.search(r"layers\.(\d+)\.", name).group(1))
        >= text_config["num_hidden_layers"]
    ]
    assert drafted and set(drafted) <= backends, drafted


@pytest.mark.parametrize(
    ("arch", "fused", "said"),
    [
        ("gfx942", False, None),
        ("gfx950", True, "fused KDA chunk kernel"),
        ("xpu", False, "XPU's attention is not built here"),
    ],
)
def test_the_stderr_note_says_what_is_not_sized_as_vllm_builds_it(
    capsys, arch, fused, said
) -> None:
    plans = [SimpleNamespace(kv_cache=SimpleNamespace(kda_checkpoint_if_fused=fused))]
    plan_cli._note_attention_borrowed(arch, "a GPU", plans)
    err = capsys.readouterr().err
    if said is None:
        assert err == ""
    else:
        assert err.startswith("plan: note: on a GPU ") and said in err
        assert len(err.strip().splitlines()) == 1


def test_each_layouts_kv_blocks_are_its_own(rocm_planners) -> None:
    """vLLM makes one MLA layer's block hold at least a KDA layer's state of
    a request (``Platform.update_block_size_for_backend``), which TP splits:
    TP8's blocks are twice TP16's, and the note under a table of both says
    each (it said the first layout's for all: 384 tokens on 16 MI308X's
    advisor, 768 for its TP8 x DP2 alone)."""
    from vllm_kimi_k3_moe.tools.plan.report import _rocm_backend_note

    gpu = ("gfx942", False)
    with an_amd_gpu_named(*gpu):
        plans = [
            rocm_planners[gpu].plan(Deployment(tp, backend=GPUS[gpu], **more))
            for tp, more in ((16, {}), (8, {"dp_size": 2}), (8, {}))
        ]
    tp16, tp8_dp2, tp8 = (p.kv_cache for p in plans)
    assert tp8.block_size == tp8_dp2.block_size == 2 * tp16.block_size
    for shape in (tp16, tp8):
        assert shape.kda_bytes_per_sequence <= shape.page_bytes  # a state a block
    note = " ".join(_rocm_backend_note(plans))
    assert note.endswith(
        f"(its KV-cache blocks, tokens per GPU: {tp8.block_size:,} at TP8, "
        f"{tp16.block_size:,} at TP16)."
    ), note
