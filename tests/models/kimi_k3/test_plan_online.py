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

import json
import re
import tempfile
from pathlib import Path

import pytest

from benchmarks.header_set import write as write_header_set
from tests.models.kimi_k3.preparation.online import PATHS, quantize_rank
from tests.models.kimi_k3.test_plan_to_check import node_blocks
from vllm_kimi_k3_moe.tools.cli import main
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    one_layer_of_each,
)
from vllm_kimi_k3_moe.tools.deployment.topology import Deployment, Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank

TP32_FP8_BLOCK = Deployment(
    32, backend="marlin", quantization="bf16", online="fp8_per_block"
)
EXPERTS = KIMI_K3_TEXT_CONFIG["num_experts"]
WIDTH = KIMI_K3_TEXT_CONFIG["routed_expert_hidden_size"]
BLOCK = 128  # FP8 per block's scale block, rows x columns


@pytest.fixture(scope="module")
def fp8_block_plan(kimi_k3_plan):
    return kimi_k3_plan(TP32_FP8_BLOCK)


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
    assert "vLLM quantizes its experts while loading them (--quantization " in (checked)
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


def test_plan_sizes_a_method_that_quantizes_the_linear_layers_too(
    kimi_model, kimi_k3_plan
):
    """FP8 per channel quantizes the linear layers as well: plan builds them
    with vLLM's own linear-kernel choice (per-token FP8, as on the GPU),
    and gives the routed experts the runtime's rows."""
    (path,) = [p for p in PATHS if p.name == "fp8_per_channel"]
    runtime = quantize_rank(kimi_model, path, "triton", Rank(Topology(32)))
    assert runtime.error is None, runtime.error
    deployment = Deployment(
        32, backend="triton", quantization="bf16", online="fp8_per_channel"
    )
    moe = kimi_k3_plan(deployment).moe
    runtime_rows = runtime.experts.moe_config.intermediate_size_per_partition
    assert moe.fixed.intermediate_per_rank == runtime_rows == 96
    assert moe.upstream.intermediate_per_rank == 256


def planned(capsys, *args: str) -> dict:
    """``plan ... --json``'s one deployment."""
    out, _ = printed(capsys, "plan", *args, "--json")
    (document,) = json.loads(out)
    return document


def refusal(capsys, *args: str) -> str:
    """The one line ``plan`` ends with where it cannot size what it was
    asked."""
    with pytest.raises(SystemExit) as exited:
        main(["plan", *args])
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def runtime_rows(kimi_model, name: str, backend: str) -> int:
    """GPU 0 of TP32's rows, quantized by ``name`` on the CPU as at runtime
    (on the GPU generation the method is built for)."""
    (path,) = [p for p in PATHS if p.name == name]
    runtime = quantize_rank(kimi_model, path, backend, Rank(Topology(32)))
    assert runtime.error is None, runtime.error
    return runtime.experts.moe_config.intermediate_size_per_partition


def test_a_method_built_on_blackwell_only_is_sized_on_the_gpu_named(
    kimi_model, capsys
) -> None:
    """vLLM builds ``nvfp4_per_token`` only on a Blackwell GPU (its method
    asks the platform): with ``--gpu b200`` plan builds as there and gives
    the runtime's rows; with no GPU named it says which GPUs build it."""
    document = planned(
        capsys, "--quantization", "nvfp4_per_token", "--gpu", "b200", "--tp", "32"
    )
    rows = runtime_rows(kimi_model, "nvfp4_per_token", "marlin")
    assert document["fixed_per_layer"]["intermediate_per_rank"] == rows == 128
    assert document["upstream_per_layer"]["intermediate_per_rank"] == 256
    assert "--quantization nvfp4_per_token" in document["serve_command"]
    line = refusal(capsys, "--quantization", "nvfp4_per_token", "--tp", "32")
    assert "requires a Blackwell" in line  # vLLM's own words
    assert line.endswith("vLLM builds it on --gpu b200, gb200, b300, gb300"), line


def test_a_backend_vllm_refuses_names_the_backends_it_builds_on(capsys) -> None:
    """FP8 per channel has no Marlin kernel (plan's default backend): the
    refusal is vLLM's, and the backends plan names instead are those vLLM
    alone builds the method on (``PATHS``, held to vLLM's selection)."""
    line = refusal(capsys, "--quantization", "fp8_per_channel", "--tp", "32")
    assert "MARLIN backend" in line  # vLLM's own words
    named = line.rsplit("vLLM builds it with --moe-backend ", 1)[1]
    (path,) = [p for p in PATHS if p.name == "fp8_per_channel"]
    assert set(re.findall(r"[a-z0-9_]+", named)) - {"not", "known", "here"} >= set(
        path.backends
    ), line
    assert "marlin" not in named


@pytest.mark.slow
def test_mxfp4_over_a_bf16_checkpoint_quantizes_while_loading(
    kimi_model, tmp_path: Path, capsys
) -> None:
    """``--quantization mxfp4`` over a BF16 checkpoint (``--config`` declares
    no quantization_config) is vLLM's online MXFP4, as vLLM reads it: sized
    as the runtime quantizes it; without ``--config`` it is the release."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK3ForConditionalGeneration"],
                "text_config": KIMI_K3_TEXT_CONFIG,
            }
        )
    )
    asked = ("--quantization", "mxfp4", "--gpu", "b200", "--tp", "32")
    online = planned(capsys, "--config", str(tmp_path), *asked)
    rows = runtime_rows(kimi_model, "mxfp4", "marlin")
    assert online["fixed_per_layer"]["intermediate_per_rank"] == rows
    assert (
        "what Mxfp4OnlineMoEMethod quantizes"
        in (online["fixed_per_layer"]["partition_reason"])
    )
    assert "--quantization mxfp4" in online["serve_command"]
    release = planned(capsys, *asked)
    assert "--quantization" not in release["serve_command"]
    assert "Mxfp4OnlineMoEMethod" not in release["fixed_per_layer"]["partition_reason"]


ONLINE_FP8_BLOCK = json.dumps({"moe": "fp8_per_block"})


def test_quantization_config_is_sized_and_checked_as_printed(
    kimi_model, tmp_path: Path, capsys
) -> None:
    """``--quantization online --quantization-config '{"moe": ...}'``: the
    flags the runtime's CPU path quantizes with (``OnlinePath.online``);
    plan gives the runtime's rows, prints both flags in its serve line, and
    check takes that line as printed, with the same rows."""
    asked = ("--quantization", "online", "--quantization-config", ONLINE_FP8_BLOCK)
    document = planned(capsys, *asked, "--tp", "32")
    assert document["fixed_per_layer"]["intermediate_per_rank"] == 128
    assert document["upstream_per_layer"]["intermediate_per_rank"] == 256
    write_header_set(tmp_path, "bf16")
    out, _ = printed(
        capsys, "plan", *asked, "--gpu", "b300", "--tp", "32", "--model", str(tmp_path)
    )
    head = node_blocks(out)["node 0"]
    assert f"--quantization-config '{ONLINE_FP8_BLOCK}'" in head
    checked, _ = printed(capsys, "check", "--serve-command", head)
    assert checked.splitlines()[-1].startswith("OK "), checked
    assert "128 intermediate rows per expert with this plugin (upstream 256)" in (
        checked
    )


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        (("--quantization", "online"), "--quantization-config"),
        (("--quantization-config", ONLINE_FP8_BLOCK), "--quantization online"),
        (("--quantization", "online", "--quantization-config", "{moe"), "not JSON"),
        (
            ("--quantization", "online", "--quantization-config", '{"moe": "fp9"}'),
            "unknown quantization name 'fp9'",  # vLLM's own words
        ),
    ],
)
def test_a_quantization_config_plan_cannot_size_is_refused_in_one_line(
    capsys, asked, named
) -> None:
    assert named in refusal(capsys, *asked)


@pytest.mark.parametrize(
    ("method", "scales"),
    [
        ("fp8_per_block", (7168 // BLOCK) * (WIDTH // BLOCK)),  # per block
        ("fp8_per_tensor", 1),  # one, the all-reduced maximum's
    ],
)
def test_plan_counts_the_linear_layers_a_method_quantizes_too(
    kimi_model, capsys, method, scales
) -> None:
    """FP8 per block and per tensor quantize the linear layers as well
    (their shorthands' ``linear`` spec): the latent projections (7168 x
    3584 and back, whole on every GPU) are counted as FP8 values and their
    FP32 scales, not as the BF16 vLLM allocates before quantizing."""
    document = planned(capsys, "--quantization", method, "--tp", "32")
    assert KIMI_K3_TEXT_CONFIG["hidden_size"] == 7168
    projection = 7168 * WIDTH  # one byte per FP8 value
    for side in ("fixed_per_layer", "upstream_per_layer"):
        assert document[side]["latent_bytes"] == 2 * (projection + 4 * scales)


@pytest.mark.parametrize("method", ["fp8_per_tensor", "fp8_per_channel", "mxfp8"])
def test_every_linear_layer_a_method_quantizes_is_counted_quantized(
    kimi_model, method
) -> None:
    """Each linear layer the method quantizes (tensor-parallel ones too,
    whose scale vLLM takes over the GPUs sharding them) is run through
    vLLM's own quantization on ``meta``; none is left counted as BF16."""
    from vllm_kimi_k3_moe.tools.deployment.topology import Serving
    from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
    from vllm_kimi_k3_moe.tools.meta_rank.whole_model import build_rank

    layers = one_layer_of_each(KIMI_K3_TEXT_CONFIG)
    serving = Serving(language_model_only=True)
    deployment = Deployment(32, backend="triton", quantization="bf16", online=method)
    with tempfile.TemporaryDirectory() as directory:
        model_dir = write_model_dir(layers, None, serving, Path(directory))
        built = build_rank(kimi_model.KimiMoE, layers, deployment, serving, model_dir)
    quantized, left = built.online_linear
    assert quantized > 0 and left == 0, built.online_linear


def assert_meta_like(got: tuple, reference: tuple) -> None:
    """Each of ``got`` a ``meta`` tensor of its ``reference`` tensor's shape,
    strides and dtype."""
    for tensor, expected in zip(got, reference, strict=True):
        assert tensor.device.type == "meta"
        assert (tensor.shape, tensor.stride(), tensor.dtype) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
        )


@pytest.mark.parametrize(
    "shape, axis", [((192, 3584), -1), ((3584, 96), -1), ((7, 64, 128), 1)]
)
def test_mxfp4_on_meta_is_what_the_torch_reference_gives(kimi_model, shape, axis):
    """On ``meta`` the stood-in MXFP4 downcast (online MXFP4, which vLLM runs
    once per expert) answers from the shapes vLLM's torch reference gives
    for that input, asked once per shape: the same shapes, strides and
    dtypes, a new tensor each call, the scale's shape as the kernel returns
    it."""
    import torch
    from vllm.model_executor.layers.quantization.utils import mxfp4_utils
    from vllm.third_party.triton_kernels.numerics_details.mxfp import (
        downcast_to_mxfp_torch,
    )

    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import online_method_quantizers

    src = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    reference = downcast_to_mxfp_torch(src, torch.uint8, axis)
    with online_method_quantizers():
        first = mxfp4_utils.downcast_to_mxfp(src, axis)
        again = mxfp4_utils.downcast_to_mxfp(src, axis)
    for got in (first, again):
        quant, scale, scale_shape = got
        assert_meta_like((quant, scale), reference)
        assert scale_shape == tuple(reference[1].shape)
    assert first[0] is not again[0]


@pytest.mark.parametrize("shape", [(192, 3584), (3584, 96), (100, 130)])
def test_fp8_per_block_on_meta_is_what_its_python_gives(kimi_model, shape):
    """On ``meta`` online FP8 per block's quantizer (vLLM compiles it) is
    answered by its own Python, once per shape: the same shapes, strides
    and dtypes, new tensors each call."""
    import torch
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import online_method_quantizers

    src = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    compiled = online_fp8.per_block_cast_to_fp8
    reference = compiled.__wrapped__(src, block_size=[BLOCK, BLOCK], use_ue8m0=False)
    with online_method_quantizers():
        first, again = (
            online_fp8.per_block_cast_to_fp8(
                src, block_size=[BLOCK, BLOCK], use_ue8m0=False
            )
            for _ in range(2)
        )
    assert online_fp8.per_block_cast_to_fp8 is compiled  # put back
    for got in (first, again):
        assert_meta_like(got, reference)
    assert first[0] is not again[0]
