"""vLLM's speculative-decoding draft of a rank, built on the ``meta`` device.

``vllm serve --speculative-config`` makes a ``SpeculativeConfig``
(``EngineArgs.create_speculative_config``: the draft's ``ModelConfig`` from
its ``config.json``, its parallel config from the target's, vLLM's checks of
the pair) and, once the target model is loaded, the GPU model runner loads
the draft with the loader of its method (``init_speculator``: DSpark's
``load_dspark_model``, MTP's ``load_eagle_model``): the draft's own config
derived from the target's, the draft built and loaded
(``model_loader.get_model``), then the target's embedding and ``lm_head``
shared with it where vLLM shares them. Here the same functions run, with
the loader building and loading nothing (``stand_ins.
weightless_model_loader``), so the draft's parameters and attention layers
are vLLM's own: its layers register in the forward context the KV-cache
planner reads (``kv_cache``), and what it adds to a GPU is its parameters
that are not the target's (``own_parameters``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.speculation import CONFIG_FILE, Speculation
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import (
    cuda_hybrid_kv_cache,
    weightless_model_loader,
)


def for_vllm(speculation: Speculation, draft_dir: Path) -> dict[str, Any]:
    """The ``--speculative-config`` vLLM is given here: as the operator's,
    its draft (``model``) the directory holding the draft's ``config.json``
    (``write_draft_dir``); MTP's draft is the target's own."""
    spec = {key: value for key, value in speculation.spec.items() if key != "model"}
    if speculation.draft_config is not None:
        spec["model"] = str(draft_dir)
    return spec


def write_draft_dir(speculation: Speculation, directory: Path) -> Path:
    """The draft's ``config.json`` in ``directory`` (made if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    if speculation.draft_config is not None:
        (directory / CONFIG_FILE).write_text(json.dumps(speculation.draft_config))
    return directory


def speculative_config(
    spec: dict[str, Any], model_config: Any, parallel_config: Any
) -> Any:
    """vLLM's ``SpeculativeConfig`` for ``spec`` (``for_vllm``'s) next to
    the target's configs, made as ``vllm serve`` makes it."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(speculative_config=dict(spec)).create_speculative_config(
        target_model_config=model_config, target_parallel_config=parallel_config
    )


def build_draft(target: Any, vllm_config: Any) -> Any:
    """The draft vLLM's model runner loads next to ``target`` (built under
    ``vllm_config``, which holds the ``SpeculativeConfig``), with the loader
    of its method, built on ``meta`` and loaded with nothing."""
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    # init_speculator's choice for Kimi-K3's methods: DSparkSpeculator, and
    # the MTP speculators (one module or several), which load_eagle_model
    loaders = {"dspark": load_dspark_model, "mtp": load_eagle_model}
    method = vllm_config.speculative_config.method
    with weightless_model_loader(), cuda_hybrid_kv_cache():
        return loaders[method](target, vllm_config)


def own_parameters(draft: Any, target: Any) -> Iterator[tuple[str, Any]]:
    """The draft's parameters that are not the target's (vLLM shares the
    target's embedding and ``lm_head`` with it where it can)."""
    shared = {id(parameter) for parameter in target.parameters()}
    for name, parameter in draft.named_parameters():
        if id(parameter) not in shared:
            yield name, parameter
