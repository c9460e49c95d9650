"""GPU presets for ``plan --gpu NAME``: each GPU's memory as vLLM sees it.

vLLM takes ``--gpu-memory-utilization`` of the total a CUDA process sees
(``torch.cuda.mem_get_info()``), which is ``nvidia-smi``'s "Total" less the
driver's reserved memory (``nvidia-smi -q``: "Reserved"), 0.5-0.9 GiB, and
below the marketed figure. Each preset is that CUDA total in MiB, with where
it was read; ``--gpu-memory-gib`` stays for any other GPU or driver.
Plain Python: the command line validates ``--gpu`` before vLLM is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB_PER_GIB = 1024


@dataclass(frozen=True)
class GpuPreset:
    name: str
    title: str
    cuda_total_mib: int  # what a CUDA process sees as the device's total

    @property
    def memory_gib(self) -> float:
        return round(self.cuda_total_mib / MIB_PER_GIB, 2)


GPU_PRESETS: dict[str, GpuPreset] = {
    preset.name: preset
    for preset in (
        # nvidia-smi Total 81559 MiB (github.com/wilicc/gpu-burn/issues/114,
        # github.com/NVIDIA/nccl/issues/1264), of which 480 MiB reserved
        # (github.com/NVIDIA/k8s-test-infra, tests/e2e/go/assertions/nvidiasmi/
        # testdata/hardware/qx-h100.xml); marketed 80 GB.
        GpuPreset("h100", "H100 SXM 80GB", 81559 - 480),
        # CUDA total_memory=97285 MiB (alipay/PainlessInferenceAcceleration,
        # flood/flood/ops/seg_attn.py); nvidia-smi 97871 MiB
        # (github.com/NVIDIA/nccl-tests/issues/338); marketed 96 GB.
        GpuPreset("h20", "H20 96GB", 97285),
        # PyTorch OOM "total capacity of 139.80 GiB" (stas00/ml-engineering,
        # debug/pytorch.md); nvidia-smi 143771 MiB
        # (github.com/sgl-project/sglang/issues/3196); marketed 141 GB.
        GpuPreset("h200", "H200 141GB", 143155),
        # cudaDeviceProp total 178.35 GiB (github.com/pytorch/ao/pull/4002);
        # nvidia-smi 183359 MiB, 728 MiB reserved (k8s-test-infra
        # qx-b200.xml; github.com/NVIDIA/TensorRT-LLM/issues/10278);
        # marketed 180 GB (DGX B200 user guide: 1,440 GB per 8 GPUs).
        GpuPreset("b200", "B200 180GB", 183359 - 728),
        # nvidia-smi 275040 MiB (github.com/oracle-quickstart/
        # oci-gpu-quickstarts, nvidia/B300/README-B300.md, which gives 268
        # GB per GPU); vLLM reported 267.69 GiB of it in a public benchmark;
        # marketed 288 GB (decimal: the same 275040 MiB).
        GpuPreset("b300", "B300 288GB", 274115),
        # nvidia-smi 189471 MiB, 742 MiB reserved (k8s-test-infra
        # qx-gb200.xml, AWS p6e-gb200); PyTorch OOMs give 184.31 GiB;
        # marketed 186 GB (NVIDIA MIG user guide).
        GpuPreset("gb200", "GB200 186GB", 189471 - 742),
        # nvidia-smi 284208 MiB, 947 MiB reserved (k8s-test-infra
        # qx-gb300.xml; oci-gpu-quickstarts nvidia/GB300/README-GB300.md);
        # no CUDA measurement found: total less reserved; marketed 288 GB.
        GpuPreset("gb300", "GB300 288GB", 284208 - 947),
    )
}


class GpuError(ValueError):
    """An unknown GPU name; one line."""


def gpu_preset(name: str) -> GpuPreset:
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise GpuError(
            f"unknown --gpu {name!r}; choose one of {', '.join(GPU_PRESETS)}, "
            "or give --gpu-memory-gib"
        ) from None
