"""vLLM's Triton MoE kernel, run on a CPU by Triton's interpreter.

Where a layout's kernel is vLLM's Triton MoE GEMM (``--moe-backend triton``:
``TritonExperts``), a CPU can run the very kernel a GPU runs:
``fused_moe_kernel`` (through ``invoke_fused_moe_triton_kernel``) and the
Triton activation quantization it calls, executed by Triton's interpreter
(``TRITON_INTERPRET=1``: each program instance in numpy). Two environment
variables must be set before Triton or vLLM is imported
(``interpret_triton``): ``TRITON_INTERPRET=1`` (``triton.jit`` decides at
decoration, when vLLM's kernel modules are imported, whether a function is
compiled or interpreted) and ``CUDA_VISIBLE_DEVICES=""`` (vLLM's
``triton_utils`` disables Triton at import when no driver is active, unless
the visible-device list is empty, as Ray leaves it).

``InterpretedTriton`` is a ``KernelPath``: the rank's kernel is selected as
on its GPU, its weights prepared by the method's own
``process_weights_after_loading`` on the CPU, and its forward is vLLM's MoE
runner, as ``SelectedKernel`` runs it on a GPU; only the CUDA-only ops
around the Triton kernels are stood in (``stand_ins.triton_moe_forward_on_cpu``).
The interpreter computes BF16 wrong (outputs of 1e11 where the answer is
4): the layer's BF16 parameters are widened to FP32 after preparation
(exactly: every BF16 value is an FP32 value) and the activations fed in
FP32, so the kernel's compute type is FP32 (FP8 layers: the kernel's own,
FP8 inputs with an FP32 accumulator).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import triton_moe_forward_on_cpu
from vllm_kimi_k3_moe.tools.selftest.kernels import (
    RankKernel,
    cpu_selection,
    forward_context,
    prepared_experts,
    selected_kernel,
)

if TYPE_CHECKING:
    from torch import Tensor, nn

    from vllm_kimi_k3_moe.tools.deployment.topology import Deployment

# What Triton and vLLM must see when they are imported.
INTERPRETER_ENVIRONMENT = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
# The --moe-backend whose kernel is vLLM's Triton MoE GEMM.
TRITON_BACKEND = "triton"
# What the interpreter computes in: BF16 it gets wrong (module docstring).
COMPUTE_DTYPE_NAME = "float32"


def interpret_triton() -> None:
    """Set the interpreter's environment; before vLLM or Triton is imported,
    or it does nothing for kernels already decorated."""
    already = [name for name in ("triton", "vllm") if name in sys.modules]
    assert not already, f"{already} imported before Triton's interpreter was set"
    os.environ.update(INTERPRETER_ENVIRONMENT)


def interpret_triton_if_possible() -> bool:
    """Choose Triton's interpreter where nothing has imported Triton or vLLM
    yet (a fresh ``selftest`` process); whether this process now runs Triton
    kernels interpreted (not where vLLM was imported without it: a caller
    that imported vLLM first gets the CPU reference kernel)."""
    if not any(name in sys.modules for name in ("triton", "vllm")):
        interpret_triton()
    return interpreted()


def interpreted() -> bool:
    """Whether this process runs Triton kernels in the interpreter: set before
    Triton was imported, and vLLM kept Triton on."""
    if any(os.environ.get(k) != v for k, v in INTERPRETER_ENVIRONMENT.items()):
        return False
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def _widened_to_fp32(experts: nn.Module) -> None:
    """The layer's BF16 parameters in FP32, exactly (module docstring)."""
    import torch

    for param in experts.parameters(recurse=False):
        if param.dtype == torch.bfloat16:
            param.data = param.data.float()


class InterpretedTriton:
    """vLLM's Triton MoE kernel on the CPU, by Triton's interpreter."""

    timed = False
    interpreted = True  # the report says so
    # FP32 on every rank (FP8 layers: FP8 inputs, FP32 sums), summed in
    # another order than the float64 reference
    floor = 1e-5
    # Not 128 tokens: the interpreter runs the kernel's programs one at a
    # time, and 128 tokens' blocks of routed slots cost most of the run
    # (``--tp 2`` FP8 blocks: 2 min 45 s with them on a busy 2-core box).
    batch_sizes = (1, 16)

    def __init__(self) -> None:
        import torch

        assert interpreted(), "Triton's interpreter is not on (interpret_triton)"
        self.device = torch.device("cpu")

    def selection(self, deployment: Deployment) -> Any:
        return cpu_selection(deployment)

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> RankKernel:
        import torch

        moe, experts = prepared_experts(model, vllm_config, self.device)
        _widened_to_fp32(experts)
        runner = moe.experts

        def forward(hidden: Tensor, logits: Tensor) -> Tensor:
            # as MoERunner.forward (SelectedKernel's), in FP32
            with triton_moe_forward_on_cpu():
                padded, _, _ = runner._maybe_pad_hidden_states(
                    None, hidden.to(torch.float32)
                )
                _, output = runner._apply_quant_method(
                    hidden_states=padded,
                    router_logits=logits,
                    shared_experts_input=None,
                )
            return output[..., : hidden.shape[-1]]

        return RankKernel(forward, forward_context(vllm_config))

    def kernel(self, experts: nn.Module) -> str:
        return (
            f"{selected_kernel(experts)}: vLLM's Triton kernels, interpreted on "
            f"the CPU (TRITON_INTERPRET=1), in {COMPUTE_DTYPE_NAME}"
        )
