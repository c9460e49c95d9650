"""What the in-tree verification borrows from the plugin project: the one
place that imports it (those modules may move; only this file follows them).

None of these patch vLLM. They pose a CPU process as one rank of a GPU
deployment (``simulated_rank``), let vLLM pick each MoE kernel as on its GPU
(``moe_kernels_on_their_gpu``), name the kernel a method selected
(``backend_name``, as the plugin's log names it), and describe Kimi-K3's
published checkpoint formats: each format's vLLM quantization config and its
routed-expert checkpoint tensors, with seeded non-zero data. The regression suite's
tables of expected behaviour (partitions per format and topology, FP8 block
and NVFP4 row placement) and its traced-checkpoint helpers come from here
too, so the in-tree form is held to the same numbers as the plugin. So is
the plugin's own judgement of a vLLM (``judged_with``, ``verdict``): on the
patched copy each fix the patch carries is "already in vLLM".
"""

from __future__ import annotations

from tests.models.kimi_k3.builders import kimi_k3_text_config
from tests.models.kimi_k3.format_checkpoints import expert_checkpoint
from tests.models.kimi_k3.gpu_stand_ins import uninitialised_memory_reads
from tests.models.kimi_k3.kimi_k3_checkpoint import KimiK3Spec
from tests.models.kimi_k3.kimi_k3_formats import (
    LEARNED_FORMAT,
    PUBLISHED_FORMATS,
    format_vllm_config,
)
from tests.models.kimi_k3.test_fp8_block_and_nvfp4_loading import (
    CASES as PLACEMENTS,
)
from tests.models.kimi_k3.test_fp8_block_and_nvfp4_loading import (
    IDS as PLACEMENT_IDS,
)
from tests.models.kimi_k3.test_fp8_block_and_nvfp4_loading import (
    expected_placement,
)
from tests.models.kimi_k3.test_never_worse_than_vllm_alone import (
    ALIGNED_TOPOLOGIES,
    PARTITIONS,
    TOPOLOGIES,
)
from tests.models.kimi_k3.traced_checkpoint import (
    checkpoint_indices,
    digit_planes,
    load_and_decode,
)
from vllm_kimi_k3_moe import KIMI_K3_AMD_LINEAR, MODEL_PATCHES, PARTITION_PATCH
from vllm_kimi_k3_moe import patches_judged_with as judged_with
from vllm_kimi_k3_moe.model_executor.layers.fused_moe.kernel_rows import backend_name
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank, simulated_rank
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import moe_kernels_on_their_gpu
from vllm_kimi_k3_moe.verification import verdict

__all__ = [
    "ALIGNED_TOPOLOGIES",
    "KIMI_K3_AMD_LINEAR",
    "LEARNED_FORMAT",
    "MATRIX_FORMATS",
    "MODEL_PATCHES",
    "PARTITIONS",
    "PARTITION_PATCH",
    "PLACEMENTS",
    "PLACEMENT_IDS",
    "PUBLISHED_FORMATS",
    "TOPOLOGIES",
    "KimiK3Spec",
    "Rank",
    "Topology",
    "backend_name",
    "checkpoint_indices",
    "digit_planes",
    "expected_placement",
    "expert_checkpoint",
    "format_vllm_config",
    "judged_with",
    "kimi_k3_text_config",
    "load_and_decode",
    "moe_kernels_on_their_gpu",
    "plugin_package",
    "simulated_rank",
    "uninitialised_memory_reads",
    "verdict",
]

# The plugin's top-level package: a class from it in KimiMoE's MRO means the
# plugin patched the model.
plugin_package = "vllm_kimi_k3_moe"

# The matrix's formats: every published one, and a config beside them that
# the in-tree form pads as the plugin does (quantization_space): INT4 in
# asymmetric groups of 128 (zero points packed along the rows).
MATRIX_FORMATS = (*PUBLISHED_FORMATS, "ct-int4-g128-asym")
