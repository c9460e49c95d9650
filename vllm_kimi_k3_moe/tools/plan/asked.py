"""What ``plan`` was asked, validated: the text config, the format and its
``quantization_config``, the GPU budget, the layouts (of the explicit mode;
the advisor enumerates its own), the serving options and the draft.

Every input error is raised here (``INPUT_ERRORS``, one line each) before
vLLM's model is imported; the command line ends on it. What the operator
should know about the question (a TP size left out, an option that changes
nothing here, a preset's assumption) is said through the caller's ``say``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.formats import (
    FORMAT_NAMES,
    FormatError,
    KimiK3Format,
    format_named,
    recognise,
)
from vllm_kimi_k3_moe.formats.adapters import adapters_quantized
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import BudgetError, GpuBudget
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    AITER_VARIABLE,
    AMD_MOE_BACKENDS,
    XPU,
    GpuError,
    MemoryGiven,
    amd_moe_backends,
    an_amd_gpu_named,
    gpu_preset,
    memory_gpu_title,
)
from vllm_kimi_k3_moe.tools.deployment.remembered import remembered
from vllm_kimi_k3_moe.tools.deployment.speculation import (
    Speculation,
    read_speculative_config,
)
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_TEXT_CONFIG,
    ConfigFileError,
    declared_quantization_config,
    read_config_document,
    read_language_model_config,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Serving,
    validate,
    validate_backend,
    validate_prefill_context_parallel,
    validate_serving,
)
from vllm_kimi_k3_moe.tools.deployment.tp_sizes import validate_deployment
from vllm_kimi_k3_moe.tools.meta_rank.kernel_gpus import (
    GPU_CAPABILITY,
    backend_vllm_selects_on_amd,
    kernel_utilization,
)
from vllm_kimi_k3_moe.tools.meta_rank.quiet import quiet_vllm
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.amd_gpu import aiter_planned
from vllm_kimi_k3_moe.tools.plan.max_model_len import max_model_len
from vllm_kimi_k3_moe.tools.plan.online_names import online_config, online_method

DEFAULT_TP_SIZES = (8, 16, 32)
# how the messages ask for a GPU size
GPU_SIZE = "--gpu NAME or --gpu-memory-gb X"
# the errors of a question plan cannot size, each one line for the operator
INPUT_ERRORS = (ConfigFileError, DeploymentError, BudgetError, GpuError, FormatError)


@dataclass(frozen=True)
class PlanInput:
    """What ``plan`` was asked, validated."""

    text_config: dict[str, Any]
    quantization: str  # the format's name
    # --config's own quantization_config; None: the format's published one
    quantization_config: dict[str, Any] | None
    quantization_title: str  # how the tables name it
    deployments: list[Deployment]  # explicit mode; the advisor enumerates
    serving: Serving
    budget: GpuBudget | None
    # the preset's name, or the memory given, in GB: how every line names it
    gpu_title: str | None
    backend: str  # --moe-backend, as vLLM spells it
    speculation: Speculation | None  # --speculative-config
    # --quantization naming a vLLM method that quantizes the BF16 checkpoint
    # while loading it (``online_names``); None: a checkpoint format
    online: str | None = None
    # --gpu NAME's compute capability: vLLM builds as on that GPU; None: no
    # GPU named (any GPU that runs the kernel)
    capability: tuple[int, int] | None = None
    # --quantization-config, as vLLM is given it (JSON); None: not given
    online_config: str | None = None
    # --gpu NAME's architecture where it is an AMD GPU (gfx942, gfx950), or
    # --gpu-arch's: vLLM builds its AMD model there (``gpus.an_amd_gpu_named``)
    amd_arch: str | None = None
    # AITER on there (``amd_gpu.aiter_planned``): the serve lines then carry
    # VLLM_ROCM_USE_AITER=1
    aiter: bool = False
    # --gpu-memory-gb or --gpu-memory-gib, as given; None: a preset or no GPU
    memory_given: MemoryGiven | None = None


def _budget(
    args: argparse.Namespace, quantization: str, say: Callable[[str], None]
) -> tuple[GpuBudget | None, str | None]:
    """The GPU's budget and the name every line gives it."""
    given = memory_given(args)
    if args.gpu is not None and given is not None:
        raise BudgetError(f"give --gpu or {given.words[0]}, not both")
    if args.gpu is not None:
        preset = gpu_preset(args.gpu)
        memory, title = preset.memory_gib, preset.title
    elif given is not None:
        # in GB, the unit of the answer (GB = 10^9 bytes), with the vendor:
        # never NVIDIA silently (the fits note says the option given, once)
        memory = given.gib
        title = memory_gpu_title(memory, args.gpu_arch)
    else:
        for option, value in (
            ("--gpu-memory-utilization", args.gpu_memory_utilization),
            ("--reserve-gib", args.reserve_gib),
        ):
            if value is not None:
                raise BudgetError(f"{option} needs a GPU size: add {GPU_SIZE}")
        return None, None
    # None: vLLM's default utilization and plan's estimate of the reserve,
    # which the installed vLLM decides once it is imported (kv_budget)
    utilization = args.gpu_memory_utilization
    if utilization is None:
        utilization = _kernel_utilization(quantization, args.moe_backend.lower(), say)
    budget = GpuBudget(memory, utilization, args.reserve_gib)
    return budget, title


def _kernel_utilization(
    quantization: str, backend: str, say: Callable[[str], None]
) -> float | None:
    """The ``--gpu-memory-utilization`` the kernel needs where it needs one
    (``kernel_gpus.KERNEL_UTILIZATION``), said; else None."""
    utilization = kernel_utilization(quantization, backend)
    if utilization is not None:
        say(
            f"plan: note: --moe-backend {backend} is sized and served at "
            f"--gpu-memory-utilization {utilization:g}, as vLLM's recipe runs it: "
            "its kernel allocates about 1.7 GB outside vLLM's pool on its "
            "first forward"
        )
    return utilization


def _note_kv_options_unused(
    args: argparse.Namespace, say: Callable[[str], None]
) -> None:
    """The KV-cache options change the JSON (its serve commands and
    ``kv_cache_per_gpu``) but not a table without a GPU size: say so rather
    than ignore them silently."""
    given = [
        option
        for option, value in (
            ("--kv-cache-dtype", args.kv_cache_dtype),
            ("--max-model-len", args.max_model_len),
        )
        if value is not None
    ]
    if given:
        say(
            f"plan: note: {' and '.join(given)} "
            f"{'size' if len(given) > 1 else 'sizes'} the KV cache, which the "
            f"table shows with a GPU size ({GPU_SIZE})"
        )


def _note_preset_adapters(fmt: KimiK3Format, say: Callable[[str], None]) -> None:
    """Without --config a format is sized from its preset
    ``quantization_config``; whether that quantizes the latent adapters (on
    every GPU whole: 9.45 GB in BF16) is the assumption that moves the
    figures most, and a checkpoint's own config may differ: say which."""
    if not adapters_quantized(fmt.published_quantization_config(), None):
        return
    say(
        f"plan: note: {fmt.name} is sized from plan's preset config, which "
        "quantizes the latent adapters (routed_expert_down_proj, up_proj) as "
        "the experts; a checkpoint that keeps them BF16 holds more on every "
        "GPU: give its config.json (--config DIR) to size it as it is"
    )


def plan_input(args: argparse.Namespace, say: Callable[[str], None]) -> PlanInput:
    """What ``plan`` was asked (``args``, as its parser read them), validated
    before vLLM's model is imported (a --max-model-len is read last, by
    vLLM's own parser function); what the operator should know, ``say``s.
    Raises ``INPUT_ERRORS`` (one line each)."""
    text_config = (
        KIMI_K3_TEXT_CONFIG
        if args.config is None
        else read_language_model_config(args.config)
    )
    fmt, quantization_config, quantization_title = _quantization(args)
    bf16_checkpoint = args.config is not None and quantization_config is None
    with_config = args.quantization_config is not None
    online = (
        None
        if args.quantization is None
        else online_method(args.quantization, bf16_checkpoint, with_config)
    )
    config = (
        None
        if not with_config
        else online_config(
            online, args.quantization_config, quantization_config is not None
        )
    )
    if online is not None:
        if quantization_config is not None:
            raise DeploymentError(
                f"--quantization {online} quantizes a BF16 checkpoint while "
                f"loading it, but {args.config} declares a quantization_config"
            )
        fmt = format_named("bf16")
        quantization_title = f"BF16, --quantization {online}" + (
            "" if config is None else f" --quantization-config {config}"
        )
    amd_arch = _amd_arch(args)
    aiter = aiter_planned(amd_arch)
    gpu = gpu_label(args)
    amd_asked = amd_arch and _amd_backend(args.moe_backend, fmt.name, gpu, amd_arch)
    budget, gpu_title = _budget(args, fmt.name, say)
    validate_prefill_context_parallel(args.pcp_size)
    speculation = (
        None
        if args.speculative_config is None
        else read_speculative_config(args.speculative_config, text_config)
    )
    backend = args.moe_backend.lower()
    if amd_arch is not None:  # ROCm's: asked, else vLLM's own choice there
        backend = amd_asked or _amd_default(
            text_config, fmt.name, quantization_config, gpu, amd_arch, aiter, say
        )
    if args.gpus is not None:
        explicit = [
            option
            for option, given in (
                ("--tp", args.tp_sizes is not None),
                ("--pp", args.pp_size != 1),
                ("--dp", args.dp_size != 1),
                ("--ep", args.expert_parallel),
                ("--dcp", args.dcp_size != 1),
            )
            if given
        ]
        if explicit:
            raise DeploymentError(
                f"--gpus lists every layout itself; drop {', '.join(explicit)}"
            )
        if budget is None:
            raise DeploymentError(f"--gpus needs a GPU size: add {GPU_SIZE}")
        with an_amd_gpu_named(amd_arch, aiter):
            validate_backend(fmt.name, backend, online)
        deployments, left_out = [], []
    else:
        deployments = [
            Deployment(
                tp,
                dp_size=args.dp_size,
                pp_size=args.pp_size,
                expert_parallel=args.expert_parallel,
                dcp_size=args.dcp_size,
                backend=backend,
                quantization=fmt.name,
                online=online,
                online_config=config,
            )
            for tp in args.tp_sizes or DEFAULT_TP_SIZES
        ]
        with an_amd_gpu_named(amd_arch, aiter):
            deployments, left_out = _buildable(
                text_config, deployments, args.tp_sizes is None
            )
    default = Serving()
    serving = Serving(  # --max-model-len last: vLLM's parser imports torch
        args.kv_cache_dtype or default.kv_cache_dtype,
        default.max_model_len
        if args.max_model_len is None
        # vLLM's own reading, kept: asked again, vLLM is not imported
        else remembered(
            ("vLLM's --max-model-len", args.max_model_len),
            lambda: max_model_len(args.max_model_len),
        ),
        args.language_model_only,
    )
    validate_serving(serving)
    # after every error: those are one line
    for line in left_out:
        say(line)
    if budget is None and not args.json:
        _note_kv_options_unused(args, say)
    if quantization_config is None:
        _note_preset_adapters(fmt, say)
    return PlanInput(
        text_config,
        fmt.name,
        quantization_config,
        quantization_title,
        deployments,
        serving,
        budget,
        gpu_title,
        backend,
        speculation,
        online,
        None if args.gpu is None else GPU_CAPABILITY.get(args.gpu.lower()),
        config,
        amd_arch,
        aiter,
        memory_given(args),
    )


def memory_given(args: argparse.Namespace) -> MemoryGiven | None:
    """The GPU's memory as ``--gpu-memory-gb`` or ``--gpu-memory-gib``
    gave it (one of them); None where neither did."""
    given = [
        MemoryGiven(value, unit)
        for value, unit in ((args.gpu_memory_gb, "GB"), (args.gpu_memory_gib, "GiB"))
        if value is not None
    ]
    if len(given) > 1:
        raise BudgetError("give --gpu-memory-gb or --gpu-memory-gib, not both")
    return given[0] if given else None


def _amd_arch(args: argparse.Namespace) -> str | None:
    """Where ``--gpu`` names an AMD GPU, its architecture; an Intel one,
    ``gpus.XPU``; ``--gpu-arch`` for a GPU given by its memory: where vLLM
    builds its AMD Kimi-K3 model. None otherwise (NVIDIA)."""
    if args.gpu_arch is not None and memory_given(args) is None:
        raise BudgetError(
            "--gpu-arch is the architecture of a GPU --gpu-memory-gb (or -gib) "
            "gives" + (f"; --gpu {args.gpu} has its own" if args.gpu else "")
        )
    if args.gpu is None:
        return args.gpu_arch
    return gpu_preset(args.gpu).arch


def gpu_label(args: argparse.Namespace) -> str:
    """How messages name the GPU asked: its preset, else its memory (and
    architecture)."""
    if args.gpu is not None:
        return args.gpu
    given = memory_given(args)
    if given is None:
        return "any GPU"
    return f"a {memory_gpu_title(given.gib, args.gpu_arch)} GPU"


# --moe-backend's default (``cli.common``): NVIDIA's; on an AMD GPU it names
# no ROCm kernel, and plan sizes what vLLM selects there instead
_NVIDIA_DEFAULT_BACKEND = "marlin"


def _amd_backend(asked: str, quantization: str, gpu: str, arch: str) -> str | None:
    """The ``--moe-backend`` asked for an AMD GPU where ROCm has it; None
    for the NVIDIA default, which names no ROCm kernel (``amd_default``
    then asks vLLM); a ``DeploymentError`` otherwise."""
    backends = amd_moe_backends(quantization, arch)
    if not backends:
        raise DeploymentError(
            f"--gpu {gpu}: plan knows vLLM's AMD and Intel MoE backends for "
            f"{', '.join(AMD_MOE_BACKENDS)} only, not {quantization}"
        )
    asked = asked.lower()
    if asked in backends:
        return asked
    if asked == _NVIDIA_DEFAULT_BACKEND:
        return None
    raise DeploymentError(
        f"unknown MoE backend {asked!r} for {quantization} on {gpu}; "
        f"choose one of {', '.join(backends)}"
    )


def _amd_default(
    text_config: dict[str, Any],
    quantization: str,
    quantization_config: dict[str, Any] | None,
    gpu: str,
    arch: str,
    aiter: bool,
    say: Callable[[str], None],
) -> str:
    """The backend to plan on the AMD or Intel GPU ``gpu``: what vLLM selects
    there with ``--moe-backend auto``, else the first it builds
    (``kernel_gpus.backend_vllm_selects_on_amd``; kept as plan's answers
    are), said. Imports vLLM."""

    def ask_vllm() -> tuple[str, str | None]:
        with quiet_vllm(), an_amd_gpu_named(arch, aiter):
            return backend_vllm_selects_on_amd(
                text_config, quantization, quantization_config
            )

    backend, auto_refused = remembered(
        ("vLLM's --moe-backend auto", arch, aiter, text_config, quantization_config),
        ask_vllm,
    )
    if auto_refused is not None:
        say(
            f"plan: note: on {gpu} vLLM's --moe-backend auto gives no MoE "
            f"kernel here ({auto_refused}); plan sizes --moe-backend {backend}, "
            "the first vLLM builds there, which the serve lines name"
        )
        return backend
    said = "" if arch == XPU else f" ({_aiter_words(arch, aiter)})"
    say(
        f"plan: note: on {gpu} plan sizes --moe-backend {backend}: what vLLM "
        f"selects there with --moe-backend auto{said}; the serve lines "
        "name it, as a vLLM recipes report (vllm-project/recipes#838) found "
        "auto did not start Kimi-K3 on MI325X where emulation did"
    )
    return backend


def _aiter_words(arch: str, aiter: bool) -> str:
    """AITER's setting plan plans with, and why, in words."""
    if AITER_VARIABLE in os.environ:
        return f"AITER {'on' if aiter else 'off'}: {AITER_VARIABLE} is set"
    if aiter:
        return (
            f"AITER on, {AITER_VARIABLE}=1, as vLLM's Kimi-K3 recipe serves "
            f"{arch}; --moe-backend emulation or {AITER_VARIABLE}=0 for the "
            "emulation experts"
        )
    return f"AITER off, vLLM's default on {arch}"


def _quantization(
    args: argparse.Namespace,
) -> tuple[KimiK3Format, dict[str, Any] | None, str]:
    """The format to size, the quantization_config to build it from (None:
    its published one) and its name for the tables: ``--config``'s own
    ``quantization_config`` where it declares one (any config vLLM takes:
    INT4 or INT8 in any group, symmetric or not, AutoAWQ, AutoGPTQ), as vLLM
    will pick the experts' method, else ``--quantization`` (mxfp4 by
    default)."""
    declared = None
    if args.config is not None:
        declared = declared_quantization_config(read_config_document(args.config))
    if declared is None:
        name = args.quantization or "mxfp4"
        fmt = format_named(name if name in FORMAT_NAMES else "bf16")
        return fmt, None, fmt.title
    recognised = recognise(declared, None, str(args.config))
    if args.quantization in FORMAT_NAMES and args.quantization not in (
        None,
        recognised.format.name,
    ):
        raise DeploymentError(
            f"--quantization {args.quantization}, but {args.config} declares "
            f"{recognised.name} ({recognised.format.name}); drop --quantization"
        )
    return recognised.format, declared, recognised.name


def _buildable(
    text_config: dict[str, Any], deployments: list[Deployment], defaults: bool
) -> tuple[list[Deployment], list[str]]:
    """The deployments vLLM builds. Sizes the operator named must all build
    (the first that does not is the error); of the default TP sizes, those
    that do not are left out, each said in a line for stderr, unless none
    builds (then the first one's reason is the error)."""
    kept, left_out = [], []
    for deployment in deployments:
        try:
            (validate if defaults else validate_deployment)(text_config, deployment)
        except DeploymentError as error:
            if not defaults:
                raise
            left_out.append((deployment, error))
            continue
        kept.append(deployment)
    if not kept:
        raise left_out[0][1]
    return kept, [f"plan: left out {d.label()}: {error}" for d, error in left_out]
