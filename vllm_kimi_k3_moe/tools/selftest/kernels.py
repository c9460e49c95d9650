"""The one part of the selftest that differs between a GPU and a CPU: how a
loaded rank's experts are run.

Both paths build, load and route the same (``harness``); each gives a
loaded rank's ``RankKernel``: ``forward(hidden, logits)``, run inside vLLM's
forward context (``set_forward_context``: kernels read it when they run,
Humming's for the batch's token count), as vLLM's model runner runs every
forward; on a GPU also the experts alone, for timing.

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
    (``stand_ins.one_gpu_for_the_data_parallel_group``), and the forward
    context has no data-parallel metadata (one GPU's tokens). Timed: the
    experts alone (``experts_alone``: the router's choice made first, as
    ``_apply_quant_method`` makes it; a monolithic kernel routes inside).

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
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm_kimi_k3_moe.tools.deployment.topology import Deployment
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    linear_kernels_on_their_gpu,
    moe_forward_on_cpu,
    moe_kernel_of_the_gpu,
    one_gpu_for_the_data_parallel_group,
)
from vllm_kimi_k3_moe.tools.selftest.dequantize import rank_weights
from vllm_kimi_k3_moe.tools.selftest.layer import kimi_moe, routed_experts
from vllm_kimi_k3_moe.tools.selftest.reference import BATCH_SIZES

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

Forward = Callable[["Tensor", "Tensor"], "Tensor"]  # (hidden, logits) -> output
# (hidden, logits) -> a call running the experts alone on them
ExpertsAlone = Callable[["Tensor", "Tensor"], Callable[[], Any]]


@dataclass
class RankKernel:
    """A loaded rank's experts, ready to run inside ``context()``."""

    forward: Forward  # the router, then the experts, as the MoE runner runs them
    context: Callable[[], AbstractContextManager[Any]]  # vLLM's forward context
    experts_alone: ExpertsAlone | None = None  # None: the path is untimed
    routes_inside: bool = False  # a monolithic kernel: routing is part of it


def forward_context(vllm_config: Any) -> Callable[[], AbstractContextManager[Any]]:
    """vLLM's forward context for a rank's forward, as the model runner sets
    it around every forward (``set_forward_context``): no attention
    metadata (no attention layer runs) and no data-parallel metadata, one
    GPU's tokens (``stand_ins.one_gpu_for_the_data_parallel_group``)."""
    from vllm.forward_context import set_forward_context

    return lambda: set_forward_context(None, vllm_config)


class KernelPath(Protocol):
    """How a loaded rank is run on this machine."""

    device: torch.device
    timed: bool  # whether its times are a GPU kernel's
    # the least error a correct layout is allowed (``harness``): what the
    # arithmetic of the path alone may add up to over the ranks
    floor: float

    def selection(self, deployment: Deployment) -> Any:
        """Entered while a rank is built: how vLLM picks its kernel here."""

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> RankKernel:
        """The rank's loaded layer, ready to run."""

    def kernel(self, experts: nn.Module) -> str:
        """What runs the experts, for the report."""


def selected_kernel(experts: nn.Module) -> str:
    """The MoE kernel vLLM selected for the rank's quantization method (its
    ``experts_cls``, chosen when the method is made), and the method."""
    method = experts.quant_method
    chosen = getattr(method, "experts_cls", None)
    name = chosen.__name__ if chosen is not None else "the method's own"
    return f"{name} ({type(method).__name__})"


def prepared_experts(
    model: nn.Module, vllm_config: Any, device: torch.device
) -> tuple[nn.Module, nn.Module]:
    """(the ``KimiMoE``, its routed experts), the experts prepared by vLLM's
    own ``process_weights_after_loading`` as on a GPU: the kernel's weight
    preparation, then its quantization config. Only the routed experts': the
    latent projections (quantized in some published formats) hold no loaded
    weights here."""
    from vllm.model_executor.model_loader.utils import (
        process_weights_after_loading,
    )

    moe = kimi_moe(model)
    experts = routed_experts(moe)
    with one_gpu_for_the_data_parallel_group(experts.quant_method.moe):
        process_weights_after_loading(experts, vllm_config.model_config, device)
        experts._ensure_moe_quant_config_init()
    return moe, experts


class SelectedKernel:
    """vLLM's own kernel for ``--moe-backend`` on this GPU."""

    timed = True
    floor = 1e-2  # each rank's BF16 output, summed over the ranks

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def selection(self, deployment: Deployment) -> Any:
        return nullcontext()  # vLLM asks this GPU

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> RankKernel:
        moe, _ = prepared_experts(model, vllm_config, self.device)
        runner = moe.experts
        dtype = vllm_config.model_config.dtype
        monolithic = runner.routed_experts.quant_method.is_monolithic

        def forward(hidden: Tensor, logits: Tensor) -> Tensor:
            # as MoERunner.forward: the input padded to the width the
            # method rounded the layer to, the routed output cut back
            padded, _, _ = runner._maybe_pad_hidden_states(None, hidden.to(dtype))
            _, output = runner._apply_quant_method(
                hidden_states=padded, router_logits=logits, shared_experts_input=None
            )
            return output[..., : hidden.shape[-1]]

        def experts_alone(hidden: Tensor, logits: Tensor) -> Callable[[], Any]:
            # _apply_quant_method's two paths, the input and routing made
            # once here: the call runs the experts kernel alone
            padded, _, _ = runner._maybe_pad_hidden_states(None, hidden.to(dtype))
            if monolithic:
                prepared = runner.router.prepare_monolithic_logits(logits)
                return lambda: runner.routed_experts.forward_monolithic(
                    x=padded, router_logits=prepared, input_ids=None
                )
            topk_weights, topk_ids = runner.router.select_experts(
                hidden_states=padded,
                router_logits=logits,
                topk_indices_dtype=runner._quant_method.topk_indices_dtype,
                input_ids=None,
            )
            return lambda: runner.routed_experts.forward_modular(
                x=padded, topk_weights=topk_weights, topk_ids=topk_ids
            )

        return RankKernel(
            forward, forward_context(vllm_config), experts_alone, monolithic
        )

    def kernel(self, experts: nn.Module) -> str:
        return selected_kernel(experts)


@contextmanager
def cpu_selection(deployment: Deployment) -> Iterator[None]:
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
        return cpu_selection(deployment)

    def prepare(self, model: nn.Module, fmt: str, vllm_config: Any) -> RankKernel:
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

        shift = _batched_id_shift(experts, config.moe_parallel_config.ep_rank)

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
                    topk_ids=topk_ids - shift,
                    activation=config.activation,
                    global_num_experts=experts.global_num_experts,
                    expert_map=None,
                    apply_router_weight_on_input=False,
                )

        return RankKernel(forward, forward_context(vllm_config))

    def kernel(self, experts: nn.Module) -> str:
        return (
            f"{selected_kernel(experts)}, run here by vLLM's CPU reference "
            "(NaiveBatchedExperts, FP32)"
        )


def _batched_id_shift(experts: nn.Module, ep_rank: int) -> int:
    """What to subtract from expert ids so that vLLM's batched reference
    finds this rank's experts. It takes rank r's to start at ``local x r``,
    which holds where the experts split evenly; vLLM places an uneven split
    (a pruned 806 over 8) with the first ``806 % 8`` ranks one heavier
    (``determine_expert_map``), so a lighter rank's experts start that many
    later. The layer's own expert map says where they start."""
    if experts.expert_map is None:  # no expert parallelism: every expert
        return 0
    first = int((experts.expert_map >= 0).nonzero().min())
    return first - experts.local_num_experts * ep_rank


def kernel_path() -> KernelPath:
    """This machine's: the selected kernel on the current CUDA device, else
    the CPU reference."""
    import torch

    if torch.cuda.is_available():
        return SelectedKernel(torch.device("cuda", torch.cuda.current_device()))
    return ReferenceKernel()
