"""vLLM alone's routed experts under online quantization flags, built on
``meta`` (nothing loaded): which kernels it builds an online method on
(``build_alone``), and which method a ``--quantization`` flag gives the
experts (``experts_method_of_flags``).
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from tests.models.kimi_k3.gpu_stand_ins import a_cuda_node
from tests.models.kimi_k3.preparation.online import OnlinePath, bf16_layer
from vllm_kimi_k3_moe.tools.deployment.topology import Topology
from vllm_kimi_k3_moe.tools.meta_rank.rank import Rank
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import OnlineQuantization
from vllm_kimi_k3_moe.tools.selftest.harness import vllm_alone


def build_alone(
    kimi_model: ModuleType,
    path: OnlinePath,
    backend: str,
    topology: Topology,
    online: OnlineQuantization | None = None,
) -> Any:
    """GPU 0's routed experts as vLLM alone builds them for ``path`` on
    ``backend`` (on ``meta``: nothing loaded), with ``online``'s flags
    instead of the path's if given; None where vLLM refuses."""
    from vllm.config import set_current_vllm_config

    from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
        linear_kernels_on_their_gpu,
        moe_kernels_on_their_gpu,
    )
    from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config
    from vllm_kimi_k3_moe.tools.selftest.layer import (
        build_moe_layers,
        kimi_moe,
        routed_experts,
    )

    layer = bf16_layer(path.checkpoint)
    try:
        with (
            vllm_alone(kimi_model),
            simulated_rank(Rank(topology)),
            moe_kernels_on_their_gpu(),
            linear_kernels_on_their_gpu(),
            a_cuda_node(8, path.capability),
        ):
            config = rank_vllm_config(
                layer.model_dir, topology, backend, online=online or path.online()
            )
            with set_current_vllm_config(config):
                model = build_moe_layers(kimi_model, kimi_model.KimiMoE, config, "meta")
            return routed_experts(kimi_moe(model))
    except Exception:  # vLLM refuses the kernel for the method
        return None


ROUTED_EXPERTS_PREFIX = "language_model.model.layers.1.block_sparse_moe.experts"


def experts_method_of_flags(
    kimi_model: ModuleType, quantization: str, moe: str | None, path: OnlinePath
) -> str | None:
    """The class of the method vLLM gives Kimi-K3's routed experts under
    ``--quantization quantization`` (and ``--quantization-config '{"moe":
    moe}'`` if given), on a BF16 checkpoint: as vLLM's online quantization
    config resolves it for them, or, for a config of its own
    (``experts_int8``), as a built layer gets it."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kimi_k3_moe.tools.meta_rank.rank import simulated_rank
    from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import rank_vllm_config

    flags = OnlineQuantization(
        quantization, None if moe is None else json.dumps({"moe": moe})
    )
    topology = Topology(16)
    with simulated_rank(Rank(topology)), a_cuda_node(8, path.capability):
        config = rank_vllm_config(
            bf16_layer().model_dir, topology, "marlin", online=flags
        )
    resolve = getattr(config.quant_config, "resolve_quant_method_cls", None)
    if resolve is not None:
        resolved = resolve(RoutedExperts, ROUTED_EXPERTS_PREFIX)
        return None if resolved is None else resolved[-1].__name__
    experts = build_alone(kimi_model, path, path.backends[0], topology, flags)
    return None if experts is None else type(experts.quant_method).__name__
