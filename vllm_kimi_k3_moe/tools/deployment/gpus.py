"""GPU presets for ``plan --gpu NAME``: each GPU's memory as vLLM sees it,
and which vendor's build of vLLM runs on it.

vLLM takes ``--gpu-memory-utilization`` of the total a CUDA process sees
(``torch.cuda.mem_get_info()``), which is ``nvidia-smi``'s "Total" less the
driver's reserved memory (``nvidia-smi -q``: "Reserved"), 0.5-0.9 GiB, and
below the marketed figure. Each preset is that CUDA total in MiB, with where
it was read; ``--gpu-memory-gb`` (or ``-gib``) gives any other GPU's. On
AMD GPUs vLLM's ROCm build reads the same torch call, which HIP answers
(PyTorch's "total capacity" in its out-of-memory message is that figure).

Why the vendor: on ROCm (and on Intel XPU) vLLM builds Kimi-K3's language
model from another file (``vllm/models/kimi_k3/amd/linear.py``) and selects
among other MoE kernels, so a plan for an AMD GPU builds that model as on
the GPU's architecture (``gfx942``: CDNA3, ``gfx950``: CDNA4), which
``an_amd_gpu_named`` holds while plan works.
Plain Python: the command line validates ``--gpu`` before vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

MIB_PER_GIB = 1024
NVIDIA, AMD, INTEL = "nvidia", "amd", "intel"
# An Intel GPU's ``GpuPreset.arch``: vLLM builds the same AMD model on XPU
XPU = "xpu"


@dataclass(frozen=True)
class GpuPreset:
    name: str
    model: str  # the GPU's name, without its memory: the title adds it in GB
    cuda_total_mib: int  # what a CUDA (HIP) process sees as the device's total
    vendor: str = NVIDIA
    # where vLLM builds its AMD Kimi-K3 model: the GPU architecture ROCm
    # reports (gcnArchName's name) on AMD, ``XPU`` on Intel; None: NVIDIA
    arch: str | None = None

    @property
    def memory_gib(self) -> float:
        return round(self.cuda_total_mib / MIB_PER_GIB, 2)

    @property
    def title(self) -> str:
        """How the answers name it: its model and its memory in their unit,
        GB, as vLLM sees it (not the datasheet's rounding: an H20 sold as
        96 GB is 102.0 GB here, the figure the fits note sizes with)."""
        return f"{self.model} ({in_gb(self.memory_gib)})"


GPU_PRESETS: dict[str, GpuPreset] = {
    preset.name: preset
    for preset in (
        # nvidia-smi Total 81559 MiB (github.com/wilicc/gpu-burn/issues/114,
        # github.com/NVIDIA/nccl/issues/1264), of which 480 MiB reserved
        # (github.com/NVIDIA/k8s-test-infra, tests/e2e/go/assertions/nvidiasmi/
        # testdata/hardware/qx-h100.xml); marketed 80 GB.
        GpuPreset("h100", "H100 SXM", 81559 - 480),
        # CUDA total_memory=97285 MiB (alipay/PainlessInferenceAcceleration,
        # flood/flood/ops/seg_attn.py); nvidia-smi 97871 MiB
        # (github.com/NVIDIA/nccl-tests/issues/338); marketed 96 GB.
        GpuPreset("h20", "H20", 97285),
        # PyTorch OOM "total capacity of 139.80 GiB" (stas00/ml-engineering,
        # debug/pytorch.md); nvidia-smi 143771 MiB
        # (github.com/sgl-project/sglang/issues/3196); marketed 141 GB.
        GpuPreset("h200", "H200", 143155),
        # cudaDeviceProp total 178.35 GiB (github.com/pytorch/ao/pull/4002);
        # nvidia-smi 183359 MiB, 728 MiB reserved (k8s-test-infra
        # qx-b200.xml; github.com/NVIDIA/TensorRT-LLM/issues/10278);
        # marketed 180 GB (DGX B200 user guide: 1,440 GB per 8 GPUs).
        GpuPreset("b200", "B200", 183359 - 728),
        # nvidia-smi 275040 MiB (github.com/oracle-quickstart/
        # oci-gpu-quickstarts, nvidia/B300/README-B300.md, which gives 268
        # GB per GPU); vLLM reported 267.69 GiB of it in a public benchmark;
        # marketed 288 GB (decimal: the same 275040 MiB).
        GpuPreset("b300", "B300", 274115),
        # nvidia-smi 189471 MiB, 742 MiB reserved (k8s-test-infra
        # qx-gb200.xml, AWS p6e-gb200); PyTorch OOMs give 184.31 GiB;
        # marketed 186 GB (NVIDIA MIG user guide).
        GpuPreset("gb200", "GB200", 189471 - 742),
        # nvidia-smi 284208 MiB, 947 MiB reserved (k8s-test-infra
        # qx-gb300.xml; oci-gpu-quickstarts nvidia/GB300/README-GB300.md);
        # no CUDA measurement found: total less reserved; marketed 288 GB.
        GpuPreset("gb300", "GB300", 284208 - 947),
    )
}

# AMD's and Intel's GPUs, apart from NVIDIA's: vLLM builds Kimi-K3 there from
# another model file and has no CUDA compute capability to ask
# (``meta_rank.kernel_gpus.GPU_CAPABILITY`` holds NVIDIA's).
ROCM_AND_XPU_PRESETS: dict[str, GpuPreset] = {
    preset.name: preset
    for preset in (
        # HIP "total capacity of 191.98 GiB" (PyTorch's out-of-memory message
        # on MI300X, AMD ROCm blogs, "GPTQ quantization on AMD GPUs" with
        # GPTQModel); marketed 192 GB (HBM3).
        GpuPreset("mi300x", "MI300X", 196588, AMD, "gfx942"),
        # The MI300X's sibling (CDNA3, gfx942) with its 192 GB of HBM3, as
        # the public question of running Kimi-K3 on two servers of 8 gives
        # it (github.com/MoonshotAI/Kimi-K3/issues/33). No HIP measurement
        # of an MI308X found: the MI300X's 191.98 GiB, the same memory.
        GpuPreset("mi308x", "MI308X", 196588, AMD, "gfx942"),
        # HIP "total capacity of 255.98 GiB" (public vLLM ROCm reports of
        # HIP out-of-memory on MI325X, e.g. the sparse-MLA decode fallback's);
        # marketed 256 GB (HBM3E).
        GpuPreset("mi325x", "MI325X", 262124, AMD, "gfx942"),
        # CDNA4 (gfx950) with the MI355X's 288 GiB of HBM3E (ROCm's GPU
        # specifications, rocm.docs.amd.com/en/latest/reference/
        # gpu-specs.html, list both so). No HIP measurement of an MI350X
        # found: the MI355X's 287.98 GiB, the same memory.
        GpuPreset("mi350x", "MI350X", 294892, AMD, "gfx950"),
        # HIP "total capacity of 287.98 GiB" (public MI355X out-of-memory
        # reports from vLLM and SGLang runs); marketed 288 GB (HBM3E).
        GpuPreset("mi355x", "MI355X", 294892, AMD, "gfx950"),
        # No measurement found of what vLLM's XPU build sees: the marketed
        # 128 GB of HBM2e (8 stacks of 16 GiB), taken as 128 GiB.
        GpuPreset("max1550", "Intel Max 1550", 128 * MIB_PER_GIB, INTEL, XPU),
    )
}

# Every preset ``--gpu`` takes
ALL_GPU_PRESETS: dict[str, GpuPreset] = {**GPU_PRESETS, **ROCM_AND_XPU_PRESETS}
# The AMD presets' names, for messages
AMD_PRESETS = tuple(n for n, p in ROCM_AND_XPU_PRESETS.items() if p.vendor == AMD)
XPU_PRESETS = tuple(n for n, p in ROCM_AND_XPU_PRESETS.items() if p.vendor == INTEL)

# The --moe-backend names vLLM's MXFP4 method takes on ROCm for Kimi-K3
# (``map_mxfp4_backend``: "emulation" is its OCP MX emulation experts,
# "aiter" every AITER MXFP4 variant), by format; plan knows AMD's MXFP4 only.
AMD_MOE_BACKENDS: dict[str, tuple[str, ...]] = {"mxfp4": ("emulation", "aiter")}
# ... and on XPU ("xpu": its own experts, which do not list Kimi-K3's SiTU
# activation, ``experts/xpu_moe.py``; emulation first for that reason)
XPU_MOE_BACKENDS: dict[str, tuple[str, ...]] = {"mxfp4": ("emulation", "xpu")}


# --gpu-arch: the architecture of an AMD GPU no preset names (given by its
# memory), the names ROCm reports (gcnArchName): CDNA3, CDNA4
GPU_ARCHS = ("gfx942", "gfx950")

# The switch vLLM's ROCm build reads for AITER's kernels (``vllm.envs``; off
# unless set). vLLM's Kimi-K3 recipe serves AMD with it on
# (github.com/vllm-project/recipes, models/moonshotai/Kimi-K3.yaml,
# hardware_overrides.amd) and verifies MI355X only; ROCm/MAD pull request
# 182 and SemiAnalysis's InferenceX pull request 2351 serve MI355X so. On
# CDNA4 plan plans as the recipe serves (AITER on), on CDNA3 as vLLM does
# by default (off: vLLM's AITER kernels for Kimi-K3's MXFP4 experts are
# gfx950's); the variable set in plan's environment overrides both.
AITER_VARIABLE = "VLLM_ROCM_USE_AITER"
RECIPE_AITER_ARCHS = ("gfx950",)


def in_gb(memory_gib: float) -> str:
    """A GPU's memory given in GiB, written as the answers write memory:
    GB (10^9 bytes), one decimal."""
    return f"{memory_gib * 2**30 / 10**9:.1f} GB"


@dataclass(frozen=True)
class MemoryGiven:
    """A GPU's memory as ``--gpu-memory-gb`` (GB = 10^9 bytes, the answers'
    unit and a datasheet's) or ``--gpu-memory-gib`` (GiB = 2^30 bytes, as
    CUDA and HIP report it) gave it, for a GPU no preset names."""

    value: float
    unit: str  # "GB" or "GiB"

    @property
    def gib(self) -> float:
        return self.value if self.unit == "GiB" else self.value * 10**9 / 2**30

    @property
    def words(self) -> list[str]:
        """The option as given, for the commands the answers print."""
        return [f"--gpu-memory-{self.unit.lower()}", f"{self.value:.15g}"]


def memory_gpu_title(memory_gib: float, arch: str | None) -> str:
    """How the tables name a GPU given by its memory, in GB (their unit),
    with its vendor: AMD and its architecture (``--gpu-arch``), else NVIDIA,
    said to be assumed."""
    size = in_gb(memory_gib)
    if arch is None:
        return f"{size} NVIDIA (assumed: no --gpu-arch)"
    return f"{size} AMD {arch}"


def planned_for(
    gpu: str | None, arch: str | None, capability: tuple[int, int] | None
) -> dict[str, str | bool | None]:
    """For an answer's JSON, the GPU it was planned for: the preset named
    (``gpu``; None: given by its memory, or no GPU), the vendor and the
    architecture vLLM was built as on (AMD's gfx name or ``xpu``, ``arch``;
    NVIDIA's compute capability as CUDA names it, ``sm_90``; None: any
    NVIDIA GPU that runs the kernel), and whether the vendor was assumed
    (NVIDIA: neither ``--gpu`` nor ``--gpu-arch`` named one)."""
    if arch == XPU:
        vendor = INTEL
    elif arch is not None:
        vendor = AMD
    else:
        vendor = NVIDIA
        arch = None if capability is None else "sm_{}{}".format(*capability)
    return {
        "gpu": gpu,
        "vendor": vendor,
        "architecture": arch,
        "vendor_assumed": gpu is None and vendor == NVIDIA,
    }


class GpuError(ValueError):
    """An unknown GPU name; one line."""


# The GPU (``GpuPreset.arch``: an AMD architecture, or ``XPU``) the tools
# build vLLM's AMD model for, while ``an_amd_gpu_named`` is entered; None:
# no AMD or Intel GPU named.
_NAMED_AMD_ARCH: ContextVar[str | None] = ContextVar("named_amd_arch", default=None)
# Whether AITER is on there (``VLLM_ROCM_USE_AITER=1``) while entered
_NAMED_AITER: ContextVar[bool] = ContextVar("named_aiter", default=False)


def named_amd_arch() -> str | None:
    """The AMD GPU architecture ``an_amd_gpu_named`` holds, if entered."""
    return _NAMED_AMD_ARCH.get()


def named_aiter() -> bool:
    """Whether the AMD GPU ``an_amd_gpu_named`` holds runs with AITER on."""
    return _NAMED_AITER.get() and named_amd_arch() not in (None, XPU)


def serving_environment() -> tuple[str, ...]:
    """The environment a ``vllm serve`` line needs on the GPU
    ``an_amd_gpu_named`` holds, as ``NAME=VALUE`` words before it: AITER's
    switch where plan planned with AITER on; nothing elsewhere."""
    return (f"{AITER_VARIABLE}=1",) if named_aiter() else ()


@contextmanager
def an_amd_gpu_named(arch: str | None, aiter: bool = False) -> Iterator[None]:
    """While entered, the tools build vLLM's model as on an AMD GPU of
    ``arch`` (``gfx942``, ``gfx950``), with AITER on where ``aiter``
    (``VLLM_ROCM_USE_AITER=1``), or an Intel one (``XPU``), where vLLM
    builds the same AMD model (None: nothing changes): vLLM's AMD Kimi-K3
    MoE, that platform's kernels (``meta_rank.stand_ins.amd_gpu``). Holds
    no vLLM state: plain Python."""
    if arch is None:
        yield
        return
    token = _NAMED_AMD_ARCH.set(arch)
    aiter_token = _NAMED_AITER.set(aiter)
    try:
        yield
    finally:
        _NAMED_AITER.reset(aiter_token)
        _NAMED_AMD_ARCH.reset(token)


def amd_moe_backends(quantization: str, arch: str | None = None) -> tuple[str, ...]:
    """The ``--moe-backend`` names ``quantization`` takes where vLLM builds
    its AMD model on ``arch`` (None: the one ``an_amd_gpu_named`` holds, else
    ROCm's): ROCm's, or on XPU Intel's (empty: none plan knows)."""
    arch = arch or named_amd_arch()
    table = XPU_MOE_BACKENDS if arch == XPU else AMD_MOE_BACKENDS
    return table.get(quantization, ())


def gpu_preset(name: str) -> GpuPreset:
    try:
        return ALL_GPU_PRESETS[name.lower()]
    except KeyError:
        raise GpuError(
            f"unknown --gpu {name!r}; choose one of {', '.join(ALL_GPU_PRESETS)}, "
            "or give its memory, --gpu-memory-gb X (with --gpu-arch "
            f"{' or '.join(GPU_ARCHS)} for an AMD GPU)"
        ) from None
