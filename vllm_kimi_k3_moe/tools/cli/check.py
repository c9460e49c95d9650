"""``vllm-kimi-k3-moe check``: preflight a Kimi-K3 checkpoint from its
``config.json`` and shard headers, before the first launch."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import FORMATS, FormatError
from vllm_kimi_k3_moe.formats.bf16 import BF16
from vllm_kimi_k3_moe.tools.check.aiter_environment import (
    AiterEnvironmentError,
    Situv2Replaced,
    replaced_situv2,
)
from vllm_kimi_k3_moe.tools.check.hub_cache import checkpoint_directory
from vllm_kimi_k3_moe.tools.check.json_report import as_json
from vllm_kimi_k3_moe.tools.check.preflight import (
    PreflightInputError,
    PreflightReport,
    preflight,
)
from vllm_kimi_k3_moe.tools.check.report import (
    allocation,
    headline,
    problem_lines,
    summary,
    verdict,
)
from vllm_kimi_k3_moe.tools.check.serve_line import (
    named_model,
    read_serve_command,
    serve_environment,
    serve_words,
)
from vllm_kimi_k3_moe.tools.cli.common import (
    fail,
    no_background_kernel_builds,
    quiet_vllm,
)
from vllm_kimi_k3_moe.tools.cli.vllm_flags import (
    add_context_parallel,
    add_dp_and_ep,
    add_vllm_flag,
)
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    ALL_GPU_PRESETS,
    AMD_MOE_BACKENDS,
    AMD_PRESETS,
    XPU_MOE_BACKENDS,
    XPU_PRESETS,
    an_amd_gpu_named,
    gpu_preset,
    named_amd_arch,
    planned_for,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Topology,
    validate_prefill_context_parallel,
)
from vllm_kimi_k3_moe.tools.meta_rank.kernel_gpus import (
    GPU_CAPABILITY,
    refuse_a_kernel_the_gpu_cannot_run,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import a_gpu_of_capability
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.amd_gpu import aiter_served
from vllm_kimi_k3_moe.tools.plan.online_names import online_config
from vllm_kimi_k3_moe.tools.plan.planner import (
    MoeMemoryPlan,
    PlanError,
    plan_deployment,
)

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def add_command(commands: Subcommands) -> None:
    check = commands.add_parser(
        "check",
        help="preflight a Kimi-K3 checkpoint before the first launch",
        description=(
            "Verify, from config.json and the safetensors shard headers only "
            "(never the tensor data; about 2 s for a release-sized header set), "
            "that every routed expert of every MoE layer (MTP draft included) "
            "has each of its gate/up/down tensors in the checkpoint's format "
            "(for example MXFP4's weight_packed and weight_scale), present once, "
            "with the format's dtype and logical shape (the contract the "
            "plugin's strict loader holds each tensor to), under the names "
            "vLLM's Kimi-K3 loader maps, and that vLLM can build the topology "
            "(the rules plan applies), given by the options or by a vllm "
            "serve line (--serve-command). Prints one screen: the cause first when "
            "the expert tensors are in another format than config.json "
            "declares, a summary, what each GPU loads, then the problems "
            "counted per kind and per shard with a few of each (--all: every "
            "one). Formats: "
            f"{'; '.join(f.title for f in FORMATS)}."
        ),
        epilog=(
            "Exit status: 0 clean; 1 problems found (listed); 2 unusable input, "
            "one line on stderr, before any shard is read: no such "
            "directory, a file instead of a directory, no config.json or "
            "shards, a quantization format check does not know, a topology "
            "vLLM cannot build (as plan refuses it), a serve command vLLM's "
            "parser refuses, an unknown --moe-backend "
            "for the format, a config.json without the attention fields "
            "--moe-backend needs, or another bad option value."
        ),
    )
    check.add_argument(
        "checkpoint",
        type=Path,
        nargs="?",
        metavar="CHECKPOINT_DIR",
        help="directory with config.json, model.safetensors.index.json and "
        "the shards (the files vLLM would load), or a Hugging Face id whose "
        "copy hf download put in the Hugging Face cache; with --serve-command, "
        "by default the model it names",
    )
    check.add_argument(
        "--serve-command",
        metavar='"vllm serve ..."',
        help="take the layout (TP, PP, DP, EP, DCP, PCP, --moe-backend) from "
        "this vllm serve command line, for example one plan printed, read by "
        "vLLM's own vllm serve parser (imports vLLM: about 10 s more); not "
        "with the layout options",
    )
    add_vllm_flag(
        check,
        "--tensor-parallel-size",
        f"tensor-parallel size (default: {DEFAULT_TP})",
    )
    add_vllm_flag(
        check,
        "--pipeline-parallel-size",
        "pipeline-parallel size: what each stage's GPUs load, its layers "
        "split as vLLM splits them (default: 1)",
    )
    add_dp_and_ep(check)
    add_context_parallel(check)
    add_vllm_flag(
        check,
        "--moe-backend",
        f"also report what {VLLM} allocates per GPU on this MoE kernel, "
        "upstream and with this plugin, by building the checkpoint's language "
        "model on the meta device as plan does (imports vLLM: about 15 s "
        "more). Names as for plan --moe-backend",
    )
    check.add_argument(
        "--gpu",
        type=str.lower,
        choices=tuple(ALL_GPU_PRESETS),
        metavar="NAME",
        help="the GPU the layout is for (as plan --gpu): on an AMD GPU "
        f"({', '.join(AMD_PRESETS)}) --moe-backend takes ROCm's names "
        f"({', '.join(dict.fromkeys(sum(AMD_MOE_BACKENDS.values(), ())))}), "
        f"on an Intel one ({', '.join(XPU_PRESETS)}) XPU's "
        f"({', '.join(dict.fromkeys(sum(XPU_MOE_BACKENDS.values(), ())))}), "
        "as plan prints them there, and vLLM's AMD Kimi-K3 MoE is built "
        "as on that GPU; on an NVIDIA one vLLM builds as on its compute "
        "capability",
    )
    check.add_argument(
        "--all",
        dest="show_all",
        action="store_true",
        help="list every problem, not a few of each kind",
    )
    check.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead (the summary, every problem and "
        "each GPU's share), for CI; same exit status",
    )
    check.set_defaults(run=run)


DEFAULT_TP = 32
# The options a serve command replaces: (option, its dest, its default).
LAYOUT_OPTIONS = (
    ("--tp", "tp_size", None),
    ("--pp", "pp_size", 1),
    ("--dp", "dp_size", 1),
    ("--ep", "expert_parallel", False),
    ("--dcp", "dcp_size", 1),
    ("--pcp", "pcp_size", 1),
    ("--moe-backend", "moe_backend", None),
)


@dataclass(frozen=True)
class CheckInput:
    """The checkpoint and the layout ``check`` was asked about."""

    checkpoint: Path
    parallelism: Topology
    pcp_size: int
    backend: str | None  # --moe-backend, as vLLM spells it
    # the serve line's --quantization (a method quantizing a BF16 checkpoint
    # while loading it, as plan prints it); None: the checkpoint's own
    quantization: str | None = None
    quantization_config: str | None = None  # its --quantization-config (JSON)


def _asked(args: argparse.Namespace) -> CheckInput:
    """From the options, or from ``--serve-command`` read by vLLM's own
    parser (then the options that give a layout are refused)."""
    if args.serve_command is None:
        if args.checkpoint is None:
            raise DeploymentError("give CHECKPOINT_DIR, or --serve-command")
        backend = None if args.moe_backend is None else args.moe_backend.lower()
        topology = Topology(
            args.tp_size or DEFAULT_TP,
            dp_size=args.dp_size,
            expert_parallel=args.expert_parallel,
            pp_size=args.pp_size,
            dcp_size=args.dcp_size,
        )
        checkpoint = checkpoint_directory(str(args.checkpoint))
        return CheckInput(checkpoint, topology, args.pcp_size, backend)
    given = [
        name for name, dest, unset in LAYOUT_OPTIONS if getattr(args, dest) != unset
    ]
    if given:
        raise DeploymentError(
            f"--serve-command gives the layout; drop {', '.join(given)}"
        )
    words = serve_words(args.serve_command)  # what is not a serve line
    model = args.checkpoint or named_model(words)
    if model is not None:  # a missing checkpoint, before vLLM's parser
        model = checkpoint_directory(str(model))
    print("reading the serve command with vLLM's parser ...", file=sys.stderr)
    with quiet_vllm():
        line = read_serve_command(args.serve_command)
    return CheckInput(
        model or checkpoint_directory(line.model),
        line.topology,
        line.pcp_size,
        None if line.moe_backend == "auto" else line.moe_backend,
        line.quantization,
        line.quantization_config,
    )


def run(args: argparse.Namespace) -> int:
    # the server's environment as a shell started from here gives it: read
    # before vLLM is imported, which sets AITER's SiTUv2 variables in its own
    inherited = dict(os.environ)
    no_background_kernel_builds()  # vLLM's parser and model on the meta device only
    preset = None if args.gpu is None else gpu_preset(args.gpu)
    arch = preset and preset.arch
    try:  # AITER as the serve line's environment (else check's own) has it
        environment = (
            {} if args.serve_command is None else serve_environment(args.serve_command)
        )
        with quiet_vllm():  # vLLM's import, where AITER's variables are set
            situv2 = replaced_situv2({**inherited, **environment})
    except (DeploymentError, AiterEnvironmentError) as error:
        fail("check", str(error))
    with an_amd_gpu_named(arch, aiter_served(arch, environment)):
        return _checked(args, GPU_CAPABILITY.get(args.gpu or ""), situv2)


def _checked(
    args: argparse.Namespace,
    capability: tuple[int, int] | None,
    situv2: Situv2Replaced | None = None,
) -> int:
    """``run``, with the GPU ``--gpu`` names held (an AMD one's
    architecture; ``capability``: an NVIDIA one's, held while vLLM's model
    is built); ``situv2``: AITER's variables the server's environment sets
    that vLLM replaces, said before the verdict."""
    try:  # refuses what it cannot use before reading the shards
        asked = _asked(args)
        validate_prefill_context_parallel(asked.pcp_size)
        report = preflight(asked.checkpoint, asked.parallelism, asked.backend)
    except (DeploymentError, PreflightInputError) as error:
        fail("check", str(error))
    backend = asked.backend
    if args.json:
        plan = (
            None
            if backend is None
            else _vllm_allocation(report, backend, asked, capability, args.gpu)
        )
        # as text: sys.stdout may be a stream without a binary buffer
        gpu = planned_for(args.gpu, named_amd_arch(), capability)
        document = as_json(report, situv2, plan, gpu)
        print(document.decode(), end="", flush=True)
        return report.status
    # The summary first: building vLLM's model takes a while.
    summarised = summary(report, _online_method(report, asked))
    print("\n".join([*headline(report), *summarised]), flush=True)
    if backend is not None:
        stages = report.stages if report.parallelism.pp_size > 1 else []
        moe = _vllm_allocation(report, backend, asked, capability, args.gpu)
        print("\n".join(allocation(moe, stages)))
    said = [] if situv2 is None else situv2.lines()
    problems = problem_lines(report.problems, args.show_all)
    print("\n".join([*said, *problems, *verdict(report)]))
    return report.status


def _online_method(report: PreflightReport, asked: CheckInput) -> str | None:
    """The serve line's ``--quantization`` where it quantizes the BF16
    checkpoint's experts while loading them (``plan``'s serve line for an
    online method); None for a quantized checkpoint (its own method)."""
    bf16 = report.layout.format.format.name == BF16.name
    return asked.quantization if bf16 and asked.quantization else None


def _vllm_allocation(
    report: PreflightReport,
    backend: str,
    asked: CheckInput,
    capability: tuple[int, int] | None = None,
    args_gpu: str | None = None,
) -> MoeMemoryPlan:
    """check --moe-backend: what vLLM allocates for the checkpoint's
    deployment, upstream and with the plugin (imports vLLM); a BF16
    checkpoint served with ``--quantization NAME`` (and
    ``--quantization-config``: ``plan``'s serve line for an online method)
    as quantized while loading, as ``plan`` sizes it."""
    print(f"building vLLM's Kimi-K3 model for {backend} ...", file=sys.stderr)
    fmt = report.layout.format.format.name
    online = _online_method(report, asked)
    try:
        config = (
            None
            if asked.quantization_config is None
            else online_config(online, asked.quantization_config, fmt != BF16.name)
        )
    except FormatError as error:
        fail("check", str(error))
    deployment = Deployment.of(report.parallelism, backend, fmt, online, config)
    assert report.layout.language_model is not None  # read with --moe-backend
    try:
        with quiet_vllm(), a_gpu_of_capability(capability):
            if args_gpu is not None and named_amd_arch() is not None:
                # vLLM's refusal there, naming AITER's switch where it is off
                refuse_a_kernel_the_gpu_cannot_run(
                    report.layout.language_model,
                    deployment,
                    args_gpu,
                    report.layout.quantization_config,
                )
            return plan_deployment(
                report.layout.language_model,
                deployment,
                quantization_config=report.layout.quantization_config,
            ).moe
    except (DeploymentError, PlanError) as error:
        fail("check", str(error))
