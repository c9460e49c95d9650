"""The one part of the selftest that differs between a GPU and a CPU: how a
loaded rank's experts are run.

Both paths build, load and route the same (``harness``); each gives a
``forward(hidden, logits)`` for a loaded rank.

``SelectedKernel`` (a CUDA device) does what vLLM 0.33.0 does on a GPU:
    ``BaseModelLoader.load_model`` builds on the device and then calls
    ``model_loader.utils.process_weights_after_loading`` (here on the routed
    experts), which hands the layer's weights to its quantization method to
    turn them into the layout of the kernel the method selected for this GPU
    (Marlin repacking, FlashInfer shuffling, ...) and to make that kernel
    (``FusedMoEKernel``); a worker has made its workspace
    (``init_workspace_manager``); the MoE runner pads the input to the
    layer's width and runs the router and that kernel
    (``MoERunner._maybe_pad_hidden_states``, ``_apply_quant_method``:
    modular kernels after the router, monolithic ones routing inside). With
    data parallelism, the kernel's prepare/finalize is made for one GPU
    (``stand_ins.one_gpu_for_the_data_parallel_group``).

``ReferenceKernel`` (no CUDA device; CI):
    the kernel is selected as on the GPU that runs it (every kernel's
    device check answering as there: ``stand_ins.moe_kernel_of_the_gpu``),
    which fixes the rank's partition; but a CPU can run no GPU kernel, nor
    the weight processing that prepares one (``vllm._C``). The loaded
    parameters, pads included, are dequantized to FP32 by vLLM's helpers and
    run, after the layer's own router, through vLLM's reference kernel
    ``FusedMoEKernel(BatchedPrepareAndFinalize, NaiveBatchedExperts)`` with
    the layer's ``FusedMoEConfig`` (SiTU and its betas), as the
    forward-equivalence tests do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

from vllm_kimi_k3_moe.tools.build.stand_ins import (
    linear_kernels_on_their_gpu,
    moe_forward_on_cpu,
    moe_kernel_of_the_gpu,
    one_gpu_for_the_data_parallel_group,
)
from vllm_kimi_k3_moe.tools.selftest.dequantize import rank_weights
from vllm_kimi_k3_moe.tools.selftest.layer import kimi_moe, routed_experts
from vllm_kimi_k3_moe.tools.selftest.reference import BATCH_SIZES
from vllm_kimi_k3_moe.tools.topology import Deployment

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

Forward = Callable[["Tensor", "Tensor"], "Tensor"]  # (hidden, logits) -> output


class KernelPath(Protocol):
    """How a loaded rank is run on this machine."""

    device: torch.device
    timed: bool  # whether its times are a GPU kernel's
    # the least error a correct layout is allowed (``harness``): what the
    # arithmetic of the path alone may add up to over the ranks
    floor: float

    def selection(self, deployment: Deployment) -> Any:
        """Entered while a rank is built: how vLLM picks its kernel here."""

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> Forward:
        """The rank's loaded layer, ready to run; its ``forward``."""

    def kernel(self, experts: nn.Module) -> str:
        """What runs the experts, for the report."""


def selected_kernel(experts: nn.Module) -> str:
    """The MoE kernel vLLM selected for the rank's quantization method (its
    ``experts_cls``, chosen when the method is made), and the method."""
    method = experts.quant_method
    chosen = getattr(method, "experts_cls", None)
    name = chosen.__name__ if chosen is not None else "the method's own"
    return f"{name} ({type(method).__name__})"


class SelectedKernel:
    """vLLM's own kernel for ``--moe-backend`` on this GPU."""

    timed = True
    floor = 1e-2  # each rank's BF16 output, summed over the ranks

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def selection(self, deployment: Deployment) -> Any:
        return nullcontext()  # vLLM asks this GPU

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> Forward:
        from vllm.model_executor.model_loader.utils import (
            process_weights_after_loading,
        )

        moe = kimi_moe(model)
        experts = routed_experts(moe)
        with one_gpu_for_the_data_parallel_group(experts.quant_method.moe):
            # the routed experts' own: the latent projections (quantized in
            # some published formats) hold no loaded weights here
            process_weights_after_loading(
                experts, vllm_config.model_config, self.device
            )
            experts._ensure_moe_quant_config_init()
        runner = moe.experts
        dtype = vllm_config.model_config.dtype

        def forward(hidden: Tensor, logits: Tensor) -> Tensor:
            # as MoERunner.forward: the input padded to the width the
            # method rounded the layer to, the routed output cut back
            padded, _, _ = runner._maybe_pad_hidden_states(None, hidden.to(dtype))
            _, output = runner._apply_quant_method(
                hidden_states=padded, router_logits=logits, shared_experts_input=None
            )
            return output[..., : hidden.shape[-1]]

        return forward

    def kernel(self, experts: nn.Module) -> str:
        return selected_kernel(experts)


@contextmanager
def _cpu_selection(deployment: Deployment) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(moe_kernel_of_the_gpu(deployment))
        # the latent projections are quantized in some published formats
        stack.enter_context(linear_kernels_on_their_gpu())
        yield


class ReferenceKernel:
    """vLLM's CPU reference kernel on the rank's dequantized weights."""

    timed = False
    floor = 1e-5  # FP32, summed in another order than the float64 reference

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")

    def selection(self, deployment: Deployment) -> Any:
        return _cpu_selection(deployment)

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> Forward:
        from vllm.model_executor.layers.fused_moe.config import (
            FUSED_MOE_UNQUANTIZED_CONFIG,
        )
        from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
            NaiveBatchedExperts,
        )
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
        from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import (
            BatchedPrepareAndFinalize,
        )

        moe = kimi_moe(model)
        experts = routed_experts(moe)
        w13, w2 = rank_weights(fmt, experts)
        config = experts.moe_config
        tokens = max(BATCH_SIZES)
        kernel = FusedMoEKernel(
            BatchedPrepareAndFinalize(
                max_num_tokens=tokens,
                num_local_experts=experts.local_num_experts,
                num_dispatchers=1,
                # its experts are this EP rank's (0 without EP)
                rank=config.moe_parallel_config.ep_rank,
            ),
            NaiveBatchedExperts(
                moe_config=config,
                quant_config=FUSED_MOE_UNQUANTIZED_CONFIG,
                max_num_tokens=tokens,
                num_dispatchers=1,
            ),
        )

        def forward(hidden: Tensor, logits: Tensor) -> Tensor:
            topk_weights, topk_ids = moe.experts.router.select_experts(
                hidden_states=hidden, router_logits=logits
            )
            with moe_forward_on_cpu():
                return kernel.apply(
                    hidden_states=hidden,
                    w1=w13,
                    w2=w2,
                    topk_weights=topk_weights,
                    topk_ids=topk_ids,
                    activation=config.activation,
                    global_num_experts=experts.global_num_experts,
                    expert_map=None,
                    apply_router_weight_on_input=False,
                )

        return forward

    def kernel(self, experts: nn.Module) -> str:
        return (
            f"{selected_kernel(experts)}, run here by vLLM's CPU reference "
            "(NaiveBatchedExperts, FP32)"
        )


def kernel_path() -> KernelPath:
    """This machine's: the selected kernel on the current CUDA device, else
    the CPU reference."""
    import torch

    if torch.cuda.is_available():
        return SelectedKernel(torch.device("cuda", torch.cuda.current_device()))
    return ReferenceKernel()
